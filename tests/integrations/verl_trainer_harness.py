"""Test harness that lets verl 0.9.1's own trainer (``verl.trainer.main_ppo``) run on a CPU-only machine
with the ``mcore_engine`` backend. Nothing here touches verl's installed files: every process that
imports verl imports this module through verl's own plugin hook (``VERL_USE_EXTERNAL_MODULES``), and
what it adds goes through verl's registries.

What verl lacks on CPU, and what is added here:

- **A CPU platform.** verl's device layer (``verl.plugin.platform``) knows CUDA, NPU and ROCm and
  falls back to CUDA on a machine without accelerators. :class:`PlatformCPU` is registered as
  ``"cpu"`` (``VERL_PLATFORM=cpu``): device ``"cpu"``, gloo, Ray's ``GPU`` resource as
  logical device slots (``ray.init(num_gpus=N)``: verl's resource pools count ``GPU`` bundles; no
  process touches CUDA), and ``torch.cpu`` as the
  device module with no-op memory statistics / cache calls (``torch.cpu`` has none; verl calls
  them after every step). verl's FLOPs counter recognises ``torch.cpu`` as the CPU.
- **The process-group backend string.** ``verl.utils.distributed.initialize_global_process_group_ray``
  builds ``"cpu:gloo,{device}:{backend}"``, which torch refuses for device ``cpu``
  ("Duplicate device type cpu"); it is wrapped to use ``"cpu:gloo"`` when the device is the CPU.
- **A rollout.** verl 0.9.1's trainer only generates through rollout *servers* (vLLM, SGLang,
  TensorRT-LLM replicas); none runs here. :class:`HFReplica` (registered in verl's
  ``RolloutReplicaRegistry`` as ``"hf_cpu"``) launches one :class:`HFRolloutServer` Ray actor per
  replica: a ``transformers`` model that samples with ``generate`` (token ids + log-probs, the
  ``TokenOutput`` verl's agent loop reads; for an MoE model with ``rollout.enable_rollout_routing_replay``
  also the ``routed_experts`` of every token fed, ``[P + R - 1, L_moe, k]`` as vLLM returns them, read
  from ``transformers``' routers by ``tests/integrations/hf_routing.py``, which also lets the server
  route by another policy, ``VERL_HARNESS_ROLLOUT_ROUTING``) and computes prompt top-k log-probs for a
  teacher
  (``prompt_logprobs``, the fields verl's teacher manager reads from vLLM). :class:`HFServerAdapter`
  (registered in verl's rollout class registry as ``("hf_cpu", "async")``) is the rollout inside
  verl's ``ActorRolloutRefWorker``: verl's weight sync (``checkpoint_engine.backend=naive``:
  ``ActorRolloutRefWorker.update_weights`` -> the engine's ``get_per_tensor_param`` ->
  ``rollout.update_weights``) hands it the actor's HF-named tensors, which it ships to its server.
  With LoRA and ``model.lora.merge=False`` (verl's default) verl sends the base once and then only
  the adapters (PEFT key names) with a ``peft_config``: the server puts them on its base model with
  PEFT, as vLLM's ``add_lora`` does (``tests/integrations/verl_peft.py``).
  The server refuses to generate while asleep (verl sleeps the replicas after each rollout and
  wakes them in the weight sync) and records, per weight version, the tensors it received and the
  requests it served (token ids in and out) under ``VERL_HARNESS_REPORT_DIR`` (the weights as the
  model computes with them: base + adapters merged), for the test to check. A request without
  ``max_tokens`` samples at most the rollout config's ``response_length`` tokens (capped by what is
  left of ``prompt_length + response_length``), as verl's vLLM server does.
- **The teacher's inference engine name.** ``DistillationTeacherModelConfig`` validates the top-k
  log-prob cap for ``vllm`` / ``sglang`` by name and refuses other engines; ``hf_cpu`` is let
  through (it takes the top-k per request, as SGLang does).

- **Images** (a vision-language folder: ``AutoModelForImageTextToText`` in the server, which takes the
  request's ``image_data`` through the folder's image processor and never samples the vision
  placeholder tokens): the multimodal processor without a video processor (torchvision does not
  import here), a ``qwen_vl_utils.process_vision_info`` stand-in (not installed here), verl 0.9.1's
  post-processing decode keeping the image placeholders (``transformers`` 5.24 refuses the processor
  call otherwise), and ``maybe_fix_3d_position_ids`` repairing the per-sample padded 3-D positions
  of verl's ``chunk_tensordict`` fallback. For every pass whose batch carries images the core
  engine's input is recorded in ``media.jsonl`` (token ids, ``(t, h, w)`` positions, grids).

The harness also records every engine verl's workers build (``EngineRegistry.new``) in
``engines.jsonl``, so the test can check that actor, reference and critic ran on ``mcore_engine``
(and the actor with LoRA), and for an MoE model the routing each pass of the core engine used, per
sequence, in ``routing.jsonl`` (the check that R3 replayed the rollout's routing).
It does not register the backend: the packaged config (``mcore_engine/integrations/verl_hydra``)
does, as for a user.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import threading
import time
from typing import Any

import torch

REPORT_ENV = "VERL_HARNESS_REPORT_DIR"
ROUTING_ENV = "VERL_HARNESS_ROLLOUT_ROUTING"  # an MoE rollout's routing (tests/integrations/hf_routing)
ROLLOUT_NAME = "hf_cpu"
RAY_RESOURCE = "GPU"  # logical slots: ray.init(num_gpus=N) on a CPU host; nothing uses CUDA


# ------------------------------------------------------------------------------------------ platform
def _register_platform() -> None:
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    for name, fn in {"empty_cache": lambda: None, "max_memory_allocated": lambda *a, **k: 0,
                     "max_memory_reserved": lambda *a, **k: 0, "memory_allocated": lambda *a, **k: 0,
                     "memory_reserved": lambda *a, **k: 0, "reset_peak_memory_stats": lambda *a, **k: None,
                     "manual_seed": torch.manual_seed, "manual_seed_all": torch.manual_seed,
                     "get_device_name": lambda *a, **k: "CPU"}.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        """verl platform for a CPU-only host (test harness)."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self) -> bool:
            return True

        def current_device(self) -> int:
            return 0

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index=None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0):
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "VERL_CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return RAY_RESOURCE

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self):
            return None


def _patch_process_group_backend() -> None:
    import verl.utils.distributed as vd

    original = vd.initialize_global_process_group_ray
    if getattr(original, "_cpu_harness", False):
        return

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and vd.get_device_name() == "cpu":
            backend = "cpu:gloo"
        return original(timeout_second=timeout_second, backend=backend)

    initialize_global_process_group_ray._cpu_harness = True
    vd.initialize_global_process_group_ray = initialize_global_process_group_ray


# ------------------------------------------------------------------------------------------ rollout
def _report(name: str, record: dict) -> None:
    root = os.environ.get(REPORT_ENV)
    if root:
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, f"{name}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


class HFRolloutServer:
    """A rollout server (Ray actor) on a ``transformers`` causal LM, fp32 on CPU: the methods verl's
    replicas, agent loop, teacher manager and checkpoint manager call on vLLM's server."""

    def __init__(self, name: str, model_path: str, teacher: bool = False, prompt_length: int = 512,
                 response_length: int = 512, max_model_len: int | None = None,
                 return_routed_experts: bool = False) -> None:
        self.name, self.teacher = name, teacher
        # R3: the routing of every token fed (rollout.enable_rollout_routing_replay), as vLLM returns it
        self.return_routed_experts = return_routed_experts
        self.routing = os.environ.get(ROUTING_ENV, "native")
        from tests.integrations.verl_peft import PeftReceiver

        self.model = _load_rollout_model(model_path)
        self.images = _image_processor(self.model, model_path)  # None: a text model
        # a VLM's vision placeholders are never sampled (a bad-words list): a trained model does not
        # emit them, this random one would (~1 in 60 tokens), and verl's post-processing would then
        # count one more image placeholder than images
        cfg = self.model.config
        self.banned = [] if self.images is None else [
            getattr(cfg, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                      "vision_end_token_id") if getattr(cfg, k, None) is not None]
        self.receiver = PeftReceiver(self.model, name)  # LoRA syncs: PEFT adapters on this model
        # the replica's rollout config (RolloutConfig), as vLLM's server reads it
        self.prompt_length, self.response_length = prompt_length, response_length
        self.max_model_len = max_model_len or self.model.config.get_text_config().max_position_embeddings
        self.awake = True
        self.version = 0  # weight updates received
        self.global_steps = None
        self.lock = threading.Lock()
        self.seed = 1234
        _report(name, {"event": "start", "model_path": model_path, "teacher": teacher, "pid": os.getpid()})

    # --- life cycle (RolloutReplica / CheckpointEngineManager)
    async def wake_up(self, tags: list[str] | None = None):
        self.awake = True

    async def sleep(self):
        self.awake = False

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def wait_for_requests_to_drain(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False, **kwargs):
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    # --- weights (HFServerAdapter.update_weights)
    async def update_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None,
                             kind: str = "full", peft_config: dict | None = None) -> int:
        """``kind`` (``verl_peft.sync_kind``): ``"full"`` weights, the LoRA ``"base"`` or the
        ``"adapter"`` tensors with verl's ``peft_config`` (applied with PEFT). The record's file holds
        the weights the model then computes with (base + adapters merged), in Hugging Face names."""
        from safetensors.torch import save_file

        with self.lock:
            self.receiver.update(kind, state, peft_config)
        self.version += 1
        self.global_steps = global_steps
        record = {"event": "update_weights", "version": self.version, "global_steps": global_steps,
                  "kind": kind, "tensors": len(state), "time": time.time(),
                  "peft_config": None if peft_config is None else
                  {k: getattr(v, "value", v) for k, v in peft_config.items()}}
        root = os.environ.get(REPORT_ENV)
        if root:
            path = os.path.join(root, f"{self.name}_weights_v{self.version}.safetensors")
            save_file({k: v.contiguous() for k, v in self.receiver.effective_state().items()}, path)
            record["file"] = path
            if kind == "adapter":  # the adapter tensors as received (PEFT key names)
                record["received"] = os.path.join(root, f"{self.name}_adapter_v{self.version}.safetensors")
                save_file({k: v.contiguous() for k, v in state.items()}, record["received"])
        _report(self.name, record)
        return self.version

    # --- generation (LLMServerClient.generate)
    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if not self.awake:
            raise RuntimeError(f"{self.name}: generate() while asleep (verl wakes replicas in the "
                               "weight sync)")
        if video_data or kwargs.get("audio_data") or (image_data and self.images is None):
            raise ValueError(f"{self.name}: {'images only' if self.images is not None else 'text only'}")
        prompt_ids = [int(t) for t in prompt_ids]
        media = self._media(prompt_ids, image_data) if image_data else {}
        with self.lock, torch.no_grad():
            if sampling_params.get("prompt_logprobs") is not None:
                out = self._prompt_logprobs(prompt_ids, int(sampling_params["prompt_logprobs"]))
            else:
                out = self._sample(prompt_ids, sampling_params, media)
        record = {"event": "generate", "version": self.version, "global_steps": self.global_steps,
                  "prompt_len": len(prompt_ids), "response_len": len(out["token_ids"]),
                  "prompt_ids": prompt_ids, "token_ids": out["token_ids"]}
        if media:
            record["image_grid_thw"] = media["image_grid_thw"].tolist()
        if out.get("routed_experts") is not None:
            record["routed_experts"] = out["routed_experts"].tolist()
        _report(self.name, record)
        out["extra_fields"]["global_steps"] = self.global_steps
        return TokenOutput(**out)

    def _max_new_tokens(self, prompt_len: int, sp: dict[str, Any]) -> int:
        """vLLM's server in verl (``vLLMHttpServer.generate``): ``max_tokens`` (or SGLang's
        ``max_new_tokens``) when the request has it, else the rollout's ``response_length`` capped
        by what is left of ``prompt_length + response_length``; within ``[1, max_model_len - prompt]``."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"{self.name}: prompt of {prompt_len} tokens leaves no room in "
                             f"max_model_len={self.max_model_len}")
        if sp.get("max_tokens") is not None:
            wanted = int(sp["max_tokens"])
        elif sp.get("max_new_tokens") is not None:
            wanted = int(sp["max_new_tokens"])
        else:
            wanted = min(self.response_length, self.prompt_length + self.response_length - prompt_len)
        return max(1, min(wanted, room))

    def _media(self, prompt_ids: list[int], images: list) -> dict[str, torch.Tensor]:
        """The images through the folder's image processor (``pixel_values``, ``image_grid_thw``), as
        vLLM's multimodal input processing; the prompt must hold one ``<|image_pad|>`` per merged patch."""
        out = self.images(images=list(images), return_tensors="pt")
        media = {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"]}
        pads = sum(t == self.model.config.image_token_id for t in prompt_ids)
        want = int(media["image_grid_thw"].prod(-1).sum()) // self.images.merge_size ** 2
        if pads != want:
            raise ValueError(f"{self.name}: {pads} image tokens in the prompt, the images make {want}")
        return media

    def _sample(self, prompt_ids: list[int], sp: dict[str, Any], media: dict | None = None) -> dict:
        """Sample with the KV cache; an MoE model routes by the server's routing policy
        (:data:`ROUTING_ENV`), and with ``return_routed_experts`` the routing of every token fed
        (prompt + response but the last token: ``[P + R - 1, L_moe, k]``, vLLM's) comes back."""
        from tests.integrations.hf_routing import RouteHooks

        moe = getattr(self.model.config, "num_experts_per_tok", None) is not None
        hooks = RouteHooks(self.model, self.routing) if moe else contextlib.nullcontext()
        with hooks:
            out = self._sample_tokens(prompt_ids, sp, media or {})
        if moe and self.return_routed_experts:
            out["routed_experts"] = hooks.routes().to(torch.int32).numpy()
        return out

    def _sample_tokens(self, prompt_ids: list[int], sp: dict[str, Any], media: dict) -> dict:
        temperature = float(sp.get("temperature", 1.0))
        max_new = self._max_new_tokens(len(prompt_ids), sp)
        top_k, top_p = int(sp.get("top_k", -1)), float(sp.get("top_p", 1.0))
        eos = self.model.generation_config.eos_token_id
        g = torch.Generator().manual_seed(self.seed)
        self.seed += 1
        ids = torch.tensor([prompt_ids])
        tokens, logps = [], []
        past = None
        for _ in range(max_new):
            if media:  # a VLM: the whole sequence each token (transformers' mRoPE positions from scratch)
                types = (ids == self.model.config.image_token_id).long()
                out = self.model(input_ids=ids, mm_token_type_ids=types, use_cache=False, **media)
            else:
                out = self.model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past,
                                 use_cache=True)
                past = out.past_key_values
            logits = out.logits[0, -1].float()
            if temperature <= 0:
                token = int(logits.argmax())
                logp = torch.log_softmax(logits, -1)[token]
            else:
                scaled = logits / temperature
                probs = torch.softmax(scaled, -1)
                if self.banned:  # never the vision placeholders (the reported log-prob is unfiltered)
                    probs[self.banned] = 0.0
                if top_k > 0:
                    kth = probs.topk(top_k).values[-1]
                    probs = torch.where(probs >= kth, probs, 0.0)
                if top_p < 1.0:
                    sorted_p, order = probs.sort(descending=True)
                    keep = sorted_p.cumsum(-1) - sorted_p < top_p
                    probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
                token = int(torch.multinomial(probs / probs.sum(), 1, generator=g))
                logp = torch.log_softmax(scaled, -1)[token]
            tokens.append(token)
            logps.append(float(logp))
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
            if eos is not None and token in ([eos] if isinstance(eos, int) else eos):
                break
        want_logprobs = sp.get("logprobs") not in (None, False)
        return {"token_ids": tokens, "log_probs": logps if want_logprobs else None,
                "stop_reason": "completed", "extra_fields": {}, "routed_experts": None}

    def _prompt_logprobs(self, ids: list[int], k: int) -> dict:
        """vLLM's ``prompt_logprobs`` as verl's ``extract_prompt_logprobs`` lays them out: row t holds the
        top-``k`` (id, log-prob) of the next-token distribution after ``ids[: t + 1]`` (``k=0``: the
        actual next token's); the last row is a zero pad."""
        logp = torch.log_softmax(self.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        if k > 0:
            vals, idx = logp[:-1].topk(k, -1)
        else:
            idx = torch.tensor(ids[1:]).unsqueeze(-1)
            vals = logp[:-1].gather(-1, idx)
        width = max(k, 1)
        prompt_ids = idx.tolist() + [[0] * width]
        prompt_logprobs = vals.tolist() + [[0.0] * width]
        return {"token_ids": [int(logp[-1].argmax())], "log_probs": None, "stop_reason": "completed",
                "extra_fields": {"prompt_ids": prompt_ids, "prompt_logprobs": prompt_logprobs}}


def _load_rollout_model(path: str):
    """The folder's ``transformers`` model, fp32, eval: a vision-language folder (``vision_config``) as
    ``AutoModelForImageTextToText``, any other as ``AutoModelForCausalLM``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vlm = getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def _image_processor(model, path: str):
    """A vision-language folder's image processor (its ``preprocessor_config.json``), or None."""
    if getattr(model.config, "vision_config", None) is None:
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path)


def _server_name(replica_rank: int, node_rank: int = 0, teacher: bool = False, suffix: str = "") -> str:
    return f"{ROLLOUT_NAME}_server_{'teacher_' if teacher else ''}{replica_rank}_{node_rank}{suffix}"


def _register_rollout() -> None:
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: HFReplica)


def _make_replica_class():
    import ray
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.replica import RolloutReplica

    class HFReplica(RolloutReplica):
        """verl rollout replica serving :class:`HFRolloutServer` (one server per replica)."""

        async def launch_servers(self):
            from verl.utils.config import omega_conf_to_dataclass

            model_config = self.model_config
            if not isinstance(model_config, HFModelConfig):
                model_config = omega_conf_to_dataclass(model_config)
            path = model_config.local_path or model_config.path
            name = _server_name(self.replica_rank, 0, self.is_teacher_model, self.name_suffix)
            server = ray.remote(HFRolloutServer).options(name=name, num_cpus=0, max_concurrency=8).remote(
                name=name, model_path=path, teacher=self.is_teacher_model,
                prompt_length=self.config.prompt_length, response_length=self.config.response_length,
                max_model_len=self.config.max_model_len,
                return_routed_experts=bool(self.config.enable_rollout_routing_replay))
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"{ROLLOUT_NAME}://{name}"

        async def sleep(self):
            await self.servers[0].sleep.remote()

    return HFReplica


class HFServerAdapter:
    """placeholder, replaced at import by :func:`_make_adapter_class` (needs verl's BaseRollout)."""


def _make_adapter_class():
    import ray
    from verl.workers.rollout.base import BaseRollout

    class HFServerAdapter(BaseRollout):
        """The rollout inside verl's ``ActorRolloutRefWorker``: receives the weight sync and ships the
        tensors to this replica's :class:`HFRolloutServer`; wakes / sleeps it."""

        def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
            super().__init__(config, model_config, device_mesh)
            rank = int(os.environ.get("RANK", 0))
            world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                     * self.config.pipeline_model_parallel_size)
            self.replica_rank = rank // world if replica_rank == -1 else replica_rank
            self.rollout_rank = rank % world
            self.is_leader_rank = self.rollout_rank == 0
            self.server = None
            self.sleep_level = 2

        def _handle(self):
            if self.server is None and self.is_leader_rank:
                self.server = ray.get_actor(_server_name(self.replica_rank))
            return self.server

        async def resume(self, tags: list[str]):
            if self._handle() is not None:
                await self.server.wake_up.remote(tags=tags)

        async def release(self):
            if self._handle() is not None:
                await self.server.sleep.remote()

        async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None,
                                 peft_config=None, base_sync_done: bool = True, **kwargs):
            """verl's ``rollout.update_weights``: with LoRA (``model.lora.merge=False``) a
            ``peft_config`` comes with the base (``base_sync_done=False``) or the adapters."""
            from tests.integrations.verl_peft import sync_kind

            assert wire_format == "named_tensors", wire_format
            state = {}
            if hasattr(weights, "__aiter__"):
                async for name, tensor in weights:
                    state[name] = tensor.detach().to("cpu", torch.float32, copy=True)
            else:
                for name, tensor in weights:  # every rank drains the (collective) generator
                    state[name] = tensor.detach().to("cpu", torch.float32, copy=True)
            if self._handle() is not None:
                kind = sync_kind(peft_config, base_sync_done)
                await self.server.update_weights.remote(state, global_steps, kind,
                                                        None if peft_config is None else dict(peft_config))

    return HFServerAdapter


def _allow_teacher_rollout() -> None:
    """verl's ``DistillationTeacherModelConfig`` checks the teacher's top-k log-prob cap per inference
    engine by name (vLLM's ``max_logprobs``; SGLang has none) and refuses any other name; the
    ``hf_cpu`` server, like SGLang, takes the top-k per request."""
    from verl.workers.config.distillation import DistillationTeacherModelConfig

    original = DistillationTeacherModelConfig._validate_topk_logprobs
    if getattr(original, "_cpu_harness", False):
        return

    def _validate_topk_logprobs(self, use_topk, topk):
        if self.inference.name == ROLLOUT_NAME:
            if use_topk and topk is None:
                raise ValueError("topk must be specified when use_topk is True.")
            return None
        return original(self, use_topk, topk)

    _validate_topk_logprobs._cpu_harness = True
    DistillationTeacherModelConfig._validate_topk_logprobs = _validate_topk_logprobs


# ------------------------------------------------------------------------------------------ images
def build_processor_without_video(path: str):
    """The folder's multimodal processor (``AutoProcessor``'s class for its ``model_type``) from its
    tokenizer and image processor, without a video processor: ``transformers``' video processors need
    torchvision, which does not import here, and ``ProcessorMixin.__init__``'s class check of the
    ``video_processor`` argument does too (skipped for None)."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, ProcessorMixin
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    cls = getattr(transformers, PROCESSOR_MAPPING_NAMES[AutoConfig.from_pretrained(path).model_type])
    tokenizer = AutoTokenizer.from_pretrained(path)
    check = ProcessorMixin.check_argument_for_proper_class

    def check_but_absent_video(self, name, arg):
        return None if name == "video_processor" and arg is None else check(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = check_but_absent_video
    try:
        return cls(image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=tokenizer,
                   video_processor=None, chat_template=tokenizer.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def _processor_without_torchvision() -> None:
    """verl builds the processor with ``AutoProcessor.from_pretrained`` (``hf_processor``) and, when that
    fails, silently runs without one (no images). Without torchvision it fails for every Qwen-VL folder
    (the video processor); then a vision-language folder gets :func:`build_processor_without_video`
    and verl's ``hf_processor`` goes on as usual (binds the model's ``get_rope_index``)."""
    from transformers import AutoConfig, AutoProcessor

    original = AutoProcessor.from_pretrained.__func__
    if getattr(original, "_cpu_harness", False):
        return

    def from_pretrained(cls, path, *args, **kwargs):
        try:
            return original(cls, path, *args, **kwargs)
        except Exception:
            try:
                vlm = getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
            except Exception:
                vlm = False
            if not vlm or importlib.util.find_spec("torchvision") is not None:
                raise
            return build_processor_without_video(path)

    from_pretrained._cpu_harness = True
    AutoProcessor.from_pretrained = classmethod(from_pretrained)


def _qwen_vl_utils_stand_in() -> None:
    """verl's ``RLHFDataset`` takes images out of the chat messages with ``qwen_vl_utils.
    process_vision_info`` (not installed here). For images already sized to a multiple of
    ``image_patch_size * 2`` (the test's) it returns them as RGB ``PIL`` images, which this stand-in
    does (it refuses other sizes and videos); installed only when the package is missing."""
    if importlib.util.find_spec("qwen_vl_utils") is not None:
        return
    import sys
    import types

    def process_vision_info(messages, image_patch_size: int = 14, return_video_metadata: bool = False, **kw):
        images = []
        for message in messages:
            content = message.get("content")
            for block in content if isinstance(content, list) else []:
                if block.get("type") == "video":
                    raise ValueError("qwen_vl_utils stand-in (test harness): no videos")
                if block.get("type") != "image":
                    continue
                image = block["image"].convert("RGB")
                factor = image_patch_size * 2
                if image.width % factor or image.height % factor:
                    raise ValueError(f"qwen_vl_utils stand-in (test harness): image {image.size} is not a "
                                     f"multiple of {factor} px (it does not resize)")
                images.append(image)
        return (images or None), None

    module = types.ModuleType("qwen_vl_utils")
    module.process_vision_info = process_vision_info
    sys.modules["qwen_vl_utils"] = module


def _multi_modal_inputs_keep_placeholders() -> None:
    """verl 0.9.1's agent loop recomputes each sample's ``multi_modal_inputs`` after the rollout
    (``AgentLoopWorker._compute_multi_modal_inputs``): it decodes the sample with
    ``skip_special_tokens=True``, which drops Qwen's ``<|image_pad|>`` (a special token), and calls the
    processor on that text and the images. ``transformers`` < 5.11 (verl's pin) let that through;
    5.24 refuses ("Found total 0 <|image_pad|> tokens and 1 images"). Here the decode keeps the image
    and video placeholders (other special tokens still dropped), so the processor gets the text it
    expects; the features are the same (the processor's ``input_ids`` are discarded either way)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.tokenizer import get_processor_token_id

    original = AgentLoopWorker._compute_multi_modal_inputs
    if getattr(original, "_cpu_harness", False):
        return

    class _KeepPlaceholders:
        def __init__(self, tokenizer, keep: set[int]):
            self.tokenizer, self.keep = tokenizer, keep

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

        def decode(self, ids, skip_special_tokens: bool = False, **kw):
            if skip_special_tokens:
                drop = set(self.tokenizer.all_special_ids) - self.keep
                ids = [t for t in ids if t not in drop]
            return self.tokenizer.decode(ids, skip_special_tokens=False, **kw)

    def _compute_multi_modal_inputs(self, output, input_ids):
        if self.processor is None:
            return original(self, output, input_ids)
        keep = {get_processor_token_id(self.processor, k) for k in ("image", "video")} - {None}
        tokenizer = self.tokenizer
        self.tokenizer = _KeepPlaceholders(tokenizer, keep)
        try:
            return original(self, output, input_ids)
        finally:
            self.tokenizer = tokenizer

    _compute_multi_modal_inputs._cpu_harness = True
    AgentLoopWorker._compute_multi_modal_inputs = _compute_multi_modal_inputs


def _repair_3d_position_ids() -> None:
    """verl 0.9.1 carries a VLM's ``position_ids`` as a 3-D jagged tensor ``[B, 4, j]`` (ragged
    dimension 2), whose ``unbind`` fails once pickled (Ray's transport loses the ragged dimension:
    verl's ``maybe_fix_3d_position_ids`` sets it back). Its ``chunk_tensordict`` then takes a fallback
    that re-packs every sample as ``[4, S]`` padded to the longest along the rows (values
    ``[B * 4, S]``, every offset step 4; seen here in the dispatch of the old-log-prob and update
    passes), which ``maybe_fix_3d_position_ids`` mislabels, and ``train_mini_batch``'s mini-batch
    selection then fails in ``unbind``. Here ``maybe_fix_3d_position_ids`` first cuts such a tensor
    back to each sample's ``input_ids`` length (ragged dimension 2 again); the adapter reads both
    layouts on its own (``mcore_engine.integrations.verl_multimodal``)."""
    import verl.utils.tensordict_utils as tu
    import verl.workers.engine.base as engine_base
    import verl.workers.engine_workers as engine_workers

    original = tu.maybe_fix_3d_position_ids
    if getattr(original, "_cpu_harness", False):
        return

    def maybe_fix_3d_position_ids(data):
        pos = data["position_ids"] if "position_ids" in data.keys() else None
        if pos is not None and pos.is_nested and pos.dim() == 3 and data["input_ids"].is_nested:
            values, counts = pos.values(), pos.offsets().diff().tolist()
            lengths = data["input_ids"].offsets().diff().tolist()
            if counts != lengths and len(set(counts)) == 1 and values.shape[0] == len(counts) * counts[0]:
                r = counts[0]
                samples = [values[i * r:(i + 1) * r, :n] for i, n in enumerate(lengths)]
                data["position_ids"] = tu.nested_tensor_from_tensor_list(samples, ragged_idx=2)
                return
        original(data)

    maybe_fix_3d_position_ids._cpu_harness = True
    for module in (tu, engine_base, engine_workers):
        module.maybe_fix_3d_position_ids = maybe_fix_3d_position_ids


def _record_engines() -> None:
    """Record each engine verl's workers build (``EngineRegistry.new``: model type, backend, class, TP
    size, sequence parallelism and precision of the core config) in
    ``engines.jsonl`` of the report folder: the test checks that every role ran on mcore_engine."""
    from verl.workers.engine.base import EngineRegistry

    original = EngineRegistry.new.__func__
    if getattr(original, "_cpu_harness", False):
        return

    def new(cls, model_type, backend, *args, **kwargs):
        engine = original(cls, model_type, backend, *args, **kwargs)
        config = kwargs.get("engine_config")
        parallel = getattr(getattr(engine, "config", None), "parallel", None)  # the core's EngineConfig
        lora = getattr(getattr(getattr(engine, "config", None), "model", None), "lora", None)
        _report("engines", {"model_type": model_type, "backend": backend, "pid": os.getpid(),
                            "class": f"{type(engine).__module__}.{type(engine).__qualname__}",
                            "forward_only": bool(getattr(config, "forward_only", False)),
                            "tp": getattr(parallel, "tensor_model_parallel_size", None),
                            "cp": getattr(parallel, "context_parallel_size", None),
                            "sequence_parallel": getattr(parallel, "sequence_parallel", None),
                            "lora_rank": getattr(lora, "rank", None),
                            "precision": getattr(getattr(engine, "config", None), "precision", None)})
        if getattr(getattr(getattr(engine, "config", None), "model", None), "moe", None) is not None:
            _record_routing(type(engine.engine))
        if hasattr(engine, "engine"):
            _record_media(type(engine.engine))
        return engine

    new._cpu_harness = True
    EngineRegistry.new = classmethod(new)


def _record_routing(core_class: type) -> None:
    """Record, for every pass of an MoE model's core engine (``MegatronEngine.forward_backward_batch``),
    the routing it used (its ``routed_experts`` output: recorded, or the replayed targets) per
    sequence with the sequence's token ids, in ``routing.jsonl``: whether the engine is forward-only
    (a reference policy), the pass forward-only, and whether the batch carried routes to replay."""
    original = core_class.forward_backward_batch
    if getattr(original, "_cpu_harness", False):
        return

    def forward_backward_batch(self, batch, loss_fn=None, forward_only=False, **kwargs):
        out = original(self, batch, loss_fn, forward_only, **kwargs)
        routes = out.get("routed_experts", None) if "routed_experts" in out.keys() else None
        if routes is not None and os.environ.get(REPORT_ENV):
            pairs = zip(batch["input_ids"].unbind(), routes.unbind(), strict=True)
            sequences = [{"ids": ids.tolist(), "routes": r.tolist()} for ids, r in pairs]
            _report("routing", {"pid": os.getpid(), "engine_forward_only": bool(self.config.forward_only),
                                "forward_only": bool(forward_only),
                                "replayed": "routed_experts" in batch.keys(),
                                "sequences": sequences})
        return out

    forward_backward_batch._cpu_harness = True
    core_class.forward_backward_batch = forward_backward_batch


def _record_media(core_class: type) -> None:
    """Record, for every pass of the core engine (``MegatronEngine.forward_backward_batch``) whose batch
    carries images or 3-D positions, what the adapter handed it, before it runs: per sample the token
    ids, the ``(t, h, w)`` positions, ``image_grid_thw`` and the ``pixel_values`` shape, in
    ``media.jsonl`` (the test recomputes the positions with ``transformers``)."""
    original = core_class.forward_backward_batch
    if getattr(original, "_cpu_harness_media", False):
        return

    def forward_backward_batch(self, batch, loss_fn=None, forward_only=False, **kwargs):
        keys = set(batch.keys())
        if os.environ.get(REPORT_ENV) and ("multi_modal_inputs" in keys or batch["position_ids"].dim() == 3):
            media = batch.get("multi_modal_inputs").tolist() if "multi_modal_inputs" in keys else None
            samples = []
            for i, ids in enumerate(batch["input_ids"].unbind()):
                m = None if media is None else media[i]
                samples.append({"ids": ids.tolist(), "positions": batch["position_ids"][i].tolist(),
                                "keys": None if m is None else sorted(m),
                                "image_grid_thw": None if m is None else m["image_grid_thw"].tolist(),
                                "pixel_values": None if m is None else list(m["pixel_values"].shape)})
            _report("media", {"pid": os.getpid(), "engine_forward_only": bool(self.config.forward_only),
                              "forward_only": bool(forward_only), "samples": samples})
        return original(self, batch, loss_fn, forward_only, **kwargs)

    forward_backward_batch._cpu_harness = getattr(original, "_cpu_harness", False)
    forward_backward_batch._cpu_harness_media = True
    core_class.forward_backward_batch = forward_backward_batch


def _install() -> None:
    global HFReplica, HFServerAdapter
    _register_platform()
    _patch_process_group_backend()
    HFReplica = _make_replica_class()
    HFServerAdapter = _make_adapter_class()
    _register_rollout()
    _allow_teacher_rollout()
    _processor_without_torchvision()
    _qwen_vl_utils_stand_in()
    _multi_modal_inputs_keep_placeholders()
    _repair_3d_position_ids()
    _record_engines()


HFReplica = None
_install()

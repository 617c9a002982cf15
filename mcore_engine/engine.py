"""MegatronEngine: Megatron-Core GPT training and inference on TensorDict batches (TP / PP / DP).

One step, as ``train_batch`` runs it::

    step = prepare_step(batch)            # flags, validation, micro-batches, packing, global counts
    zero_grad()                           # only after the batch was accepted on every DP rank
    get_forward_backward_func()(forward_step, ...)   # no pipelining, 1F1B or interleaved
        forward_step: logits = GPTModel(input_ids, position_ids, mask, packed_seq_params)  # [b, s, V/tp]
                      outputs = process_lm_head_logits(logits, labels, temperature, flags...)
                      (fused_lm_head: GPTModel returns hidden [b, s, H] and
                       outputs = process_lm_head_hidden(hidden, lm_head_weight, ...), no logits)
                      loss_i, metrics_i = loss_function(outputs_flat, data_flat, ctx)
    finalize: DP all-reduce (SUM, no averaging), embedding / layer-norm grad all-reduces
    gather_results()                      # outputs, loss, metrics: last stage -> every rank
    optimizer_step()                      # empty_cache iff top-k distillation ran; clip; step or skip

Inference: ``infer_batch`` (forward only); its ``logits_func`` runs a custom function on the scaled
logits whatever the flags (sampling, teacher top-k scoring). Weights: ``model.hf_path`` imports a
Hugging Face folder in ``initialize``; ``per_tensor_generator`` / ``export_hf`` stream or write the
model in Hugging Face names (weight sync to inference engines).

Helpers: ``mcore_engine.step`` (batch -> micro-batches, normalisers, results), ``mcore_engine.optim``
(Megatron optimizer + scheduler, the non-finite-skipping step), ``mcore_engine.loss_guard`` (a
failing loss function fails the step on every rank, no rank left in the schedule),
``mcore_engine.checkpoint``,
``mcore_engine.hf`` (Hugging Face import / export).

Loss normalisation: ``loss_function`` returns each micro-batch's CONTRIBUTION to the global loss
(divided by ``ctx.global_num_tokens``, all-reduced over DP before the micro-batch loop), Megatron
neither divides by the micro-batch count nor averages over DP (``calculate_per_token_loss=True``
and a finalize that skips the per-token rescale), so the gradient is that of
``sum_{dp, mb} loss_i`` = the global loss, whatever the split.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

from mcore_engine.config import EngineConfig
from mcore_engine.ops import scale_logits_by_temperature
from mcore_engine.platform import apply_cpu_device_layer, get_device, init_distributed

__all__ = ["MegatronEngine"]

LossFunction = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _finalize_grads_without_token_rescale(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """Megatron's ``finalize_model_grads`` with ``num_tokens=None``: the loss is already globally
    normalised, so the DP-summed gradients are final."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def _merge_logits_func(outputs: dict[str, torch.Tensor], extra: dict[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
    """``outputs`` plus a ``logits_func``'s outputs; ``ValueError`` on a key both produce."""
    clash = sorted(outputs.keys() & extra.keys())
    if clash:
        raise ValueError(f"logits_func returned {clash}, which the built-in outputs already hold; "
                         "rename them or pass builtin_outputs=False")
    return {**outputs, **extra}


class MegatronEngine:
    """Megatron-Core GPT policy engine (API.md "The engine").

    Attributes after ``initialize()``: ``model`` (list of DDP-wrapped ``GPTModel`` chunks, one per
    virtual pipeline stage), ``optimizer`` (Megatron optimizer), ``lr_scheduler``
    (``OptimizerParamScheduler``), ``global_step`` (applied optimizer updates), ``num_skipped_steps``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model: list[torch.nn.Module] = []
        self.optimizer = None
        self.lr_scheduler = None
        self.global_step = 0
        self.num_skipped_steps = 0
        self._last_distillation_use_topk = False
        self._interleaved = (config.parallel.virtual_pipeline_model_parallel_size or 1) > 1

    # ------------------------------------------------------------------ set-up
    def initialize(self) -> None:
        """Bring up distributed state, build the model chunks (with ``model.hf_path``: import that
        Hugging Face folder's weights, each rank reading only its shards), wrap them in Megatron DDP,
        build the Megatron optimizer and ``OptimizerParamScheduler``. Config errors raise before any
        process group work; a checkpoint that does not match ``config.model`` raises ``ValueError``."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from mcore_engine.model import build_model_chunks
        from mcore_engine.optim import build_optimizer, build_scheduler

        cfg = self.config
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        cfg.validate_world_size(world)
        apply_cpu_device_layer()
        init_distributed(cfg.parallel, cfg.seed)

        chunks = build_model_chunks(cfg)
        if cfg.model.hf_path is not None:  # before the DDP wrap and the optimizer's main-weight copies
            from mcore_engine.hf import load_hf_weights

            load_hf_weights(chunks, cfg.model.hf_path, cfg)
        for chunk in chunks:
            tcfg = chunk.config
            tcfg.calculate_per_token_loss = True          # no 1/num_microbatches, no DP averaging
            tcfg.finalize_model_grads_func = _finalize_grads_without_token_rescale
            # 1F1B exchanges each micro-batch's shape; the interleaved schedule gets padded,
            # equally shaped micro-batches instead (see mcore_engine.step).
            pipelined = cfg.parallel.pipeline_model_parallel_size > 1
            tcfg.variable_seq_lengths = pipelined and not self._interleaved
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer)
        self.model = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                              disable_bucketing=i > 0)
                      for i, chunk in enumerate(chunks)]
        for chunk in self.model:
            chunk.broadcast_params()
        no_sync = [chunk.no_sync for chunk in self.model]
        for chunk in chunks:
            chunk.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if cfg.model.fused_lm_head:  # the last stage returns hidden states; see _lm_head_outputs
            from mcore_engine.lm_head import output_hidden_states

            for chunk in chunks:
                if getattr(chunk, "post_process", False):
                    output_hidden_states(chunk)
        self.optimizer = build_optimizer(cfg, self.model)
        self.lr_scheduler = build_scheduler(cfg, self.optimizer)

    def _require_initialized(self) -> None:
        if self.optimizer is None:
            raise RuntimeError("MegatronEngine.initialize() must be called first")

    # ------------------------------------------------------------------ logits -> per-token outputs
    def _lm_head_logits_processor(self, logits: torch.Tensor, label: torch.Tensor | None, temperature, *,
                                  calculate_sum_pi_squared: bool, calculate_entropy: bool,
                                  distillation_use_topk: bool, distillation_only: bool,
                                  logits_processor_func: Callable | None = None, batch: Any = None,
                                  data_format: str = "thd") -> dict[str, torch.Tensor]:
        """Per-token fp32 outputs from this rank's vocab-sharded logits ``[..., V/tp]``; delegates to
        ``mcore_engine.processor.process_lm_head_logits`` with the true vocab size (padded ids get no
        mass) and ``config.logits_chunk_size``. Under ``distillation_only`` log-probs are never
        computed."""
        from mcore_engine.processor import process_lm_head_logits

        return process_lm_head_logits(
            logits, label, temperature, calculate_sum_pi_squared=calculate_sum_pi_squared,
            calculate_entropy=calculate_entropy, distillation_use_topk=distillation_use_topk,
            distillation_only=distillation_only, logits_processor_func=logits_processor_func,
            batch=batch, data_format=data_format, vocab_size=self.config.model.vocab_size,
            chunk_size=self.config.logits_chunk_size)

    def _lm_head_outputs(self, model: torch.nn.Module, output: torch.Tensor, label: torch.Tensor | None,
                         temperature, **kwargs) -> dict[str, torch.Tensor]:
        """The processor's outputs from the last stage's output: logits ``[b, s, V/tp]``, or with
        ``model.fused_lm_head`` the final hidden states ``[b, s, H]`` fed with the lm-head weight
        shard to ``mcore_engine.lm_head.process_lm_head_hidden`` (same keys; the logits never exist)."""
        if not self.config.model.fused_lm_head:
            return self._lm_head_logits_processor(output, label, temperature, **kwargs)
        from mcore_engine.lm_head import lm_head_weight, process_lm_head_hidden

        return process_lm_head_hidden(output, lm_head_weight(model), label, temperature,
                                      vocab_size=self.config.model.vocab_size,
                                      chunk_size=self.config.logits_chunk_size, **kwargs)

    # ------------------------------------------------------------------ forward / backward
    def _prepare(self, batch: TensorDictBase, logits_processor_func: Callable | None,
                 logits_func: Callable | None = None):
        from megatron.core import parallel_state

        from mcore_engine.step import prepare_step

        self._require_initialized()
        for name, func in (("logits_processor_func", logits_processor_func), ("logits_func", logits_func)):
            if self.config.model.fused_lm_head and func is not None:
                raise ValueError(f"{name} needs the logits, which model.fused_lm_head=True never builds; "
                                 "use the built-in outputs or fused_lm_head: false")
        par = self.config.parallel
        return prepare_step(
            batch, vocab_size=self.config.model.vocab_size,
            max_sequence_length=self.config.model.max_sequence_length, data_format=self.config.data_format,
            default_micro_batch_size=self.config.micro_batch_size,
            has_logits_processor_func=logits_processor_func is not None,
            pad_multiple=par.tensor_model_parallel_size if par.sequence_parallel else 1,
            min_num_micro_batches=par.pipeline_model_parallel_size if self._interleaved else 1,
            device=get_device().torch_device, dp_group=parallel_state.get_data_parallel_group(),
            common_shape=self._interleaved)

    def _run(self, step, loss_function: LossFunction | None, forward_only: bool,
             logits_processor_func: Callable | None, logits_func: Callable | None = None,
             builtin_outputs: bool = True) -> TensorDict:
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from mcore_engine.loss_guard import LossGuard
        from mcore_engine.step import attention_mask, collect_outputs, gather_results, loss_data

        flags, fmt = step.flags, self.config.data_format
        if not forward_only:  # optimizer_step's empty_cache hook follows the last pass WITH gradients
            self._last_distillation_use_topk = flags.distillation_use_topk
        guard = LossGuard()
        needs_grad = not forward_only and torch.is_grad_enabled()

        def outputs_and_loss(mb, model, output: torch.Tensor):
            inp = mb.inputs
            teacher = {"teacher_ids": inp.teacher_ids, "teacher_logprobs": inp.teacher_logprobs}
            outputs = {}
            if builtin_outputs:
                outputs = self._lm_head_outputs(
                    model, output, inp.labels, inp.temperature, calculate_entropy=flags.calculate_entropy,
                    calculate_sum_pi_squared=flags.calculate_sum_pi_squared,
                    distillation_use_topk=flags.distillation_use_topk,
                    distillation_only=flags.distillation_only, logits_processor_func=logits_processor_func,
                    batch=teacher, data_format=fmt)
            if logits_func is not None:
                outputs = _merge_logits_func(outputs, logits_func(
                    student_logits=scale_logits_by_temperature(output, inp.temperature), data=teacher,
                    data_format=fmt))
            kept = {k: v.detach() for k, v in outputs.items()}
            if loss_function is None:
                return (output.new_zeros((), dtype=torch.float32), {}), kept
            flat = {k: v.reshape(-1) for k, v in outputs.items()}
            return loss_function(flat, loss_data(mb), step.ctx), kept

        def loss_func(mb, model, output: torch.Tensor):
            loss, metrics, kept = guard.run(partial(outputs_and_loss, mb, model, output), output,
                                            needs_grad=needs_grad)
            record = {"index": mb.index, "loss": loss.detach(), "metrics": metrics, "outputs": kept}
            return loss, mb.inputs.loss_mask.sum().to(torch.int), record

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            inp = mb.inputs
            logits = model(input_ids=inp.input_ids, position_ids=inp.position_ids,
                           attention_mask=attention_mask(mb), packed_seq_params=inp.packed_seq_params)
            return logits, partial(loss_func, mb, model)

        from mcore_engine.step import micro_batch_iterator

        iterators = [micro_batch_iterator(step) for _ in self.model]
        store = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(step.micro_batches), seq_length=step.max_seq_len,
            micro_batch_size=step.max_rows, forward_only=forward_only)
        try:
            guard.raise_if_failed()
        except Exception:
            if not forward_only:  # drop the partial accumulation: the documented failure state
                self.zero_grad()
            raise

        per_mb, loss, metrics = gather_results(
            step, store, is_last_stage=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            pp_group=parallel_state.get_pipeline_model_parallel_group(),
            pp_last_rank=parallel_state.get_pipeline_model_parallel_last_rank(),
            dp_group=parallel_state.get_data_parallel_group(), device=get_device().torch_device)
        out = TensorDict({}, batch_size=[step.batch_size])
        for key, value in collect_outputs(step, per_mb).items():
            out.set(key, value)
        out.set_non_tensor("loss", loss)
        out.set_non_tensor("metrics", metrics)
        return out

    def forward_backward_batch(self, batch: TensorDictBase, loss_function: LossFunction | None,
                               forward_only: bool = False, *,
                               logits_processor_func: Callable | None = None) -> TensorDict:
        """Forward (and backward unless ``forward_only``) over all micro-batches of ``batch``.

        Gradients ACCUMULATE into the DDP grad buffers (``train_batch`` zeroes them first). Returns,
        on EVERY rank (the last pipeline stage broadcasts them to the others), a TensorDict ``[B]``
        with the per-token outputs in the layout of ``input_ids`` plus non-tensor ``loss`` (global,
        0-d) and ``metrics`` (key -> float: the loss function's metric contributions summed over
        micro-batches and DP ranks, i.e. global values). Unless ``forward_only``, records
        ``distillation_use_topk`` for ``optimizer_step``'s ``empty_cache()`` hook.

        A loss function (or lm-head processor, ``logits_processor_func``) that raises, or returns
        anything but ``(floating 0-d loss requiring grad, {name: number or one-element tensor})``,
        fails the step on EVERY rank once the schedule has ended (``mcore_engine.loss_guard``: the
        failing rank re-raises its exception, the others raise ``ValueError`` / ``RuntimeError``
        naming it; no rank hangs). Afterwards the grad buffers are ZEROED (any earlier accumulation is
        dropped too), parameters and optimizer state unchanged; RNG streams have advanced.
        """
        if loss_function is None and not forward_only:
            raise ValueError("forward_backward_batch: loss_function=None needs forward_only=True")
        step = self._prepare(batch, logits_processor_func)
        return self._run(step, loss_function, forward_only, logits_processor_func)

    def zero_grad(self) -> None:
        """Zero the DDP grad buffers and the optimizer's main grads."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def train_batch(self, batch: TensorDictBase, loss_function: LossFunction, *,
                    logits_processor_func: Callable | None = None) -> TensorDict:
        """Validate -> zero_grad -> forward_backward_batch -> optimizer_step. A bad batch raises
        ``ValueError`` before any gradient or parameter changes; a failing loss function raises on
        every rank with gradients zeroed and no update (see ``forward_backward_batch``). The metrics
        gain ``grad_norm``,
        ``update_skipped`` (1.0 when non-finite gradients skipped the update) and ``lr``."""
        step = self._prepare(batch, logits_processor_func)
        for chunk in self.model:
            chunk.train()
        self.zero_grad()
        out = self._run(step, loss_function, False, logits_processor_func)
        skipped_before = self.num_skipped_steps
        grad_norm = self.optimizer_step()
        metrics = dict(out.get_non_tensor("metrics"))
        metrics["grad_norm"] = grad_norm
        metrics["update_skipped"] = float(self.num_skipped_steps > skipped_before)
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        out.set_non_tensor("metrics", metrics)
        return out

    @torch.no_grad()
    def infer_batch(self, batch: TensorDictBase, loss_function: LossFunction | None = None, *,
                    logits_processor_func: Callable | None = None, logits_func: Callable | None = None,
                    builtin_outputs: bool = True) -> TensorDict:
        """Forward only, under ``no_grad`` and eval mode (each module's previous train / eval mode is
        restored afterwards): per-token outputs in the layout of ``input_ids`` (``log_probs`` unless
        distillation_only, ``entropy`` ... per the flags). Leaves gradients and the ``empty_cache``
        hook of ``optimizer_step`` alone.

        ``logits_processor_func`` keeps the API.md contract (called only under the batch's
        ``distillation_use_topk``). ``logits_func``, for inference-side work on the logits (sampling,
        teacher top-k scoring), runs on every micro-batch WHATEVER the flags::

            extra = logits_func(student_logits=logits / temperature,   # this rank's shard [..., V/tp]
                                data={"teacher_ids": ..., "teacher_logprobs": ...}, data_format=fmt)

        (``logits`` itself for a host-scalar temperature 1, else one scaled copy) and its dict of
        per-token tensors (shape ``student_logits.shape[:-1]`` plus any trailing dims) is merged into
        the outputs; a key that clashes with a built-in output is a ``ValueError``. With
        ``builtin_outputs=False`` the flag-driven outputs (log-probs, entropy, ...) are not computed
        at all and only ``logits_func``'s come back (``logits_func`` is then required)."""
        if not builtin_outputs and logits_func is None:
            raise ValueError("infer_batch: builtin_outputs=False needs a logits_func (nothing to compute)")
        step = self._prepare(batch, logits_processor_func, logits_func)
        modes = [(module, module.training) for chunk in self.model for module in chunk.modules()]
        for chunk in self.model:
            chunk.eval()
        try:
            return self._run(step, loss_function, True, logits_processor_func, logits_func, builtin_outputs)
        finally:
            for module, training in modes:
                module.training = training

    # ------------------------------------------------------------------ optimizer
    def optimizer_step(self) -> float:
        """``get_device().empty_cache()`` first iff the last ``forward_backward_batch`` ran with
        ``distillation_use_topk``; then clip to ``optimizer.clip_grad`` and step. Returns the
        pre-clip global grad norm. Non-finite gradients skip the update (parameters and optimizer
        state unchanged) and count in ``num_skipped_steps``."""
        from mcore_engine.optim import step_optimizer

        self._require_initialized()
        if self._last_distillation_use_topk:
            get_device().empty_cache()
        result = step_optimizer(self.optimizer, self.config.optimizer.clip_grad)
        if result.skipped:
            self.num_skipped_steps += 1
        else:
            self.global_step += 1
        return result.grad_norm

    def lr_scheduler_step(self) -> float:
        """Advance the learning-rate schedule by one step; returns the new learning rate."""
        self._require_initialized()
        self.lr_scheduler.step(1)
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ weight export (Hugging Face names)
    def per_tensor_generator(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(hf_name, full_tensor)`` for the whole model in Hugging Face names and layouts
        (TP shards gathered, vocab padding dropped), e.g. for weight sync to an inference engine:
        ``mcore_engine.hf.iter_hf_tensors(self.model, self.config, dtype=dtype)``.

        Collective over the tensor- and pipeline-parallel groups: every rank of the model-parallel
        group must consume the generator to the end, in step; every rank receives every tensor.
        ``dtype`` None: the training precision. Tensors may share storage with live parameters (copy
        them to keep them past an update). Memory: one gathered parameter at a time."""
        from mcore_engine.hf import iter_hf_tensors

        self._require_initialized()
        return iter_hf_tensors(self.model, self.config, dtype=dtype)

    def export_hf(self, out_dir: str | os.PathLike, **kwargs: Any) -> None:
        """Collective (every rank): write the model as a Hugging Face folder (safetensors +
        ``config.json``; the tokenizer files of ``model.hf_path`` when set);
        ``kwargs`` (``dtype``, ``max_shard_bytes``) go to ``mcore_engine.hf.export_hf``."""
        from mcore_engine.hf import export_hf

        self._require_initialized()
        export_hf(self.model, self.config, out_dir, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_path(self, path: str | None) -> str:
        path = path if path is not None else self.config.checkpoint_dir
        if not path:
            raise ValueError("checkpoint path is None and EngineConfig.checkpoint_dir is not set")
        return str(path)

    def save_checkpoint(self, path: str | None = None) -> None:
        """Collective: write model, optimizer, scheduler, step counters and RNG of every rank to
        folder ``path`` (default ``config.checkpoint_dir``; the same path on every rank, on a shared
        filesystem) atomically: see ``mcore_engine.checkpoint``."""
        from mcore_engine.checkpoint import save_engine_state

        self._require_initialized()
        save_engine_state(self, self._checkpoint_path(path))

    def load_checkpoint(self, path: str | None = None) -> None:
        """Collective: restore what ``save_checkpoint`` wrote; a torn, foreign or differently laid
        out checkpoint raises ``ValueError`` on every rank and leaves the engine untouched."""
        from mcore_engine.checkpoint import load_engine_state

        self._require_initialized()
        load_engine_state(self, self._checkpoint_path(path))

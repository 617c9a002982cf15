"""On-policy RL through the Tinker API: only the ``tinker`` client talks to the engine.

A toy task the tiny random model can learn in a few steps: after a fixed prompt, each sampled token
whose id is below ``--below`` earns 1 / max_tokens (a random model scores about ``below / vocab``).
Each step samples ``--group`` completions per prompt from the current weights, takes group-relative
advantages (reward minus the group's mean) and trains with Tinker's ``importance_sampling`` loss on
the sampler's own log-probs: the mean reward rises (the tiny test model of
``tests/integrations/tinker_setup.py``, full fine-tuning: 0.15 -> 1.0 in 12 steps).

    python -m mcore_engine.integrations.tinker.serve --base-model /abs/path/model --port 8000 &
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local \
        python examples/tinker_rl.py --base-model /abs/path/model
"""

from __future__ import annotations

import argparse
import time

import tinker
from tinker import types


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", required=True, help="the server's --base-model, verbatim")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--below", type=int, default=60, help="token ids below this one are rewarded")
    p.add_argument("--rank", type=int, default=0,
                   help="LoRA rank; 0 = full fine-tuning (a tiny random model needs its lm-head trained)")
    p.add_argument("--lr", type=float, default=5e-2)
    args = p.parse_args()

    service = tinker.ServiceClient()                       # TINKER_BASE_URL / TINKER_API_KEY
    trainer = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=0)
    prompts = [[5, 17, 99, 3], [250, 8, 61]]
    rewards: list[float] = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        sampler = trainer.save_weights_and_get_sampling_client()
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=step)
        futures = [sampler.sample(types.ModelInput.from_ints(pr), args.group, params) for pr in prompts]
        data, step_rewards = [], []
        for prompt, fut in zip(prompts, futures, strict=True):
            seqs = fut.result().sequences
            scores = [sum(t < args.below for t in s.tokens) / args.max_tokens for s in seqs]
            mean = sum(scores) / len(scores)
            step_rewards += scores
            for s, r in zip(seqs, scores, strict=True):
                full = prompt + s.tokens
                n_prompt = len(prompt) - 1                 # targets start at the prompt's second token
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:],
                                    "logprobs": [0.0] * n_prompt + list(s.logprobs),
                                    "advantages": [0.0] * n_prompt + [r - mean] * len(s.tokens)}))
        out = trainer.forward_backward(data, "importance_sampling").result()
        trainer.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        rewards.append(sum(step_rewards) / len(step_rewards))
        print(f"step {step}: mean reward {rewards[-1]:.3f}  loss {out.metrics['loss:sum']:+.4f}  "
              f"{len(data)} sequences  {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"mean reward {rewards[0]:.3f} -> {rewards[-1]:.3f}")


if __name__ == "__main__":
    main()

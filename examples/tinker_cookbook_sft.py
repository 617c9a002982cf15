"""tinker-cookbook's supervised trainer (``supervised.train.main``, unmodified) on its shipped
``example_data/conversations.jsonl``, against this engine's Tinker server. Run it with the cookbook's
venv (``make cookbook-venv``; the cookbook pins an older ``transformers`` than ours):

    python -m mcore_engine.integrations.tinker.serve --base-model /abs/path/model --port 8000 &
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local \
        .venv-cookbook/bin/python examples/tinker_cookbook_sft.py --base-model /abs/path/model

The mean NLL per step is in ``<log-path>/metrics.jsonl`` (``train_mean_nll``). A local folder needs
``renderer_name`` (the cookbook only knows hub names); ``role_colon`` works with any tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import tinker_cookbook
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", required=True, help="the server's --base-model, verbatim")
    p.add_argument("--log-path", default="/tmp/tinker-cookbook-sft")
    p.add_argument("--rank", type=int, default=0, help="LoRA rank; 0 = full fine-tuning")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch-size", type=int, default=16, help="conversations per step")
    p.add_argument("--max-steps", type=int, default=None)
    args = p.parse_args()

    data = os.path.join(os.path.dirname(tinker_cookbook.__file__), "example_data", "conversations.jsonl")
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.base_model, renderer_name="role_colon", max_length=512,
        batch_size=args.batch_size, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = train.Config(
        log_path=args.log_path, model_name=args.base_model, recipe_name="mcore_engine_sft",
        renderer_name="role_colon", dataset_builder=FromConversationFileBuilder(common_config=common,
                                                                                file_path=data),
        learning_rate=args.lr, lr_schedule="constant", num_epochs=1, lora_rank=args.rank, eval_every=0,
        save_every=0, max_steps=args.max_steps)
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()

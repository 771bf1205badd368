"""``python -m worker.model pool-config --model smollm2-135m``: print, as JSON,
the pool a model needs (the fields of :class:`blockd.core.types.PoolConfig`,
which ``blockctl pools create`` takes as flags). Reads the model's config
only (a GGUF file is converted into the cache on first use).

``python -m worker.model prepare --model smollm2-135m``: convert now (``make
setup`` does), so the first worker does not spend half a minute on it."""

from __future__ import annotations

import argparse
import dataclasses
import json

from blockd.config_env import positive_int
from worker.model import source
from worker.model.build import TORCH_DTYPES, load_config, pool_config_for


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.model", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pc = sub.add_parser("pool-config", help="print the pool config a model needs")
    pc.add_argument("--model", required=True,
                    help="tiny-llama, tiny-qwen2, tiny-gpt2, smollm2-135m, a GGUF file or a local "
                         "model directory")
    pc.add_argument("--name", default="model")
    pc.add_argument("--num-blocks", type=positive_int, default=1024)
    pc.add_argument("--block-size", type=positive_int, default=16)
    pc.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES))
    pr = sub.add_parser("prepare", help="convert a GGUF model into the cache now; print its directory")
    pr.add_argument("--model", default=source.DEFAULT_MODEL, help="a short name or a GGUF file")
    args = p.parse_args(argv)
    if args.command == "prepare":
        try:
            print(source.model_dir(args.model))
        except (ValueError, OSError) as err:
            raise SystemExit(str(err)) from None
        return 0
    try:
        model_config = load_config(args.model)
    except (ValueError, OSError) as err:
        raise SystemExit(str(err)) from None
    config = pool_config_for(model_config, args.name, args.num_blocks, args.block_size, dtype=args.dtype)
    print(json.dumps(dataclasses.asdict(config), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m worker.model pool-config --model tiny-llama``: print, as JSON,
the pool a model needs (the fields of :class:`blockd.core.types.PoolConfig`,
which ``blockctl pools create`` takes as flags)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from worker.model.build import TORCH_DTYPES, build_model, pool_config_for


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.model", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pc = sub.add_parser("pool-config", help="print the pool config a model needs")
    pc.add_argument("--model", required=True,
                    help="tiny-llama, tiny-qwen2, tiny-gpt2 or a local model directory")
    pc.add_argument("--name", default="model")
    pc.add_argument("--num-blocks", type=int, default=1024)
    pc.add_argument("--block-size", type=int, default=16)
    pc.add_argument("--dtype", default="float32", choices=sorted(TORCH_DTYPES))
    args = p.parse_args(argv)
    try:
        model = build_model(args.model, dtype=args.dtype)
    except (ValueError, OSError) as err:
        raise SystemExit(str(err)) from None
    config = pool_config_for(model.config, args.name, args.num_blocks, args.block_size, dtype=args.dtype)
    print(json.dumps(dataclasses.asdict(config), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

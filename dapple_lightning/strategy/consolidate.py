"""Turn a sharded dapple checkpoint into the single-device file.

Usage::

    python -m dapple_lightning.strategy.consolidate path/to/sharded.ckpt path/to/single.ckpt

The output loads with ``LightningModule.load_from_checkpoint`` and resumes under plain
Lightning or any dapple plan. It is built in this process's memory: the machine running it
needs room for the whole model and optimizer state.
"""

from __future__ import annotations

import argparse
import sys

from dapple_lightning.strategy._sharded import consolidate_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dapple_lightning.strategy.consolidate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("directory", help="a checkpoint saved with DappleStrategy(state_dict_type='sharded')")
    parser.add_argument("output", help="the single-device checkpoint file to write")
    args = parser.parse_args(argv)
    path = consolidate_checkpoint(args.directory, args.output)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

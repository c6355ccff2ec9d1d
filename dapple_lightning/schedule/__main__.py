"""``python -m dapple_lightning.schedule STAGES MICRO_BATCHES [NAME] [--chunks C]``: draw a schedule as a table.

For the schedules of several stages per rank group (``interleaved``, ``zb-v``, ``v-half``) the first
number is the rank groups ``G``, and the table has one column per group."""

import argparse

from dapple_lightning.plan import ALL_SCHEDULES, CHUNKED_SCHEDULES
from dapple_lightning.schedule import chunked_schedule, grid, schedule


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dapple_lightning.schedule",
        description="Draw every stage's order of forwards (F), backwards (B) and weight backwards (W), "
        "one column a stage, one row a time slot when every action costs one unit.",
    )
    parser.add_argument("stages", type=int, help="number of pipeline stages S (>= 1); rank groups G with chunks")
    parser.add_argument("micro_batches", type=int, help="micro-batches per step M (>= 1)")
    parser.add_argument(
        "name",
        nargs="?",
        default="dapple",
        choices=(*ALL_SCHEDULES, *CHUNKED_SCHEDULES),
        help="the schedule (default dapple)",
    )
    parser.add_argument(
        "--chunks", type=int, default=2, help="stages per rank group for interleaved (default 2; the V layout has 2)"
    )
    args = parser.parse_args()
    try:
        if args.name in CHUNKED_SCHEDULES:
            print(grid(chunked_schedule(args.name, args.stages, args.chunks, args.micro_batches)))
        else:
            print(grid(schedule(args.name, args.stages, args.micro_batches)))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()

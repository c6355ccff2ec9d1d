"""``python -m dapple_lightning.schedule STAGES MICRO_BATCHES [NAME]``: draw a schedule as a table."""

import argparse

from dapple_lightning.plan import ALL_SCHEDULES
from dapple_lightning.schedule import grid, schedule


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dapple_lightning.schedule",
        description="Draw every stage's order of forwards (F), backwards (B) and weight backwards (W), "
        "one column a stage, one row a time slot when every action costs one unit.",
    )
    parser.add_argument("stages", type=int, help="number of pipeline stages S (>= 1)")
    parser.add_argument("micro_batches", type=int, help="micro-batches per step M (>= 1)")
    parser.add_argument(
        "name", nargs="?", default="dapple", choices=ALL_SCHEDULES, help="the schedule (default dapple)"
    )
    args = parser.parse_args()
    try:
        print(grid(schedule(args.name, args.stages, args.micro_batches)))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()

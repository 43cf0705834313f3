"""``arv``: the Aggregator Runtime Verifier (placeholder until its issue lands)."""

import sys


def main() -> None:
    print("arv: not implemented yet", file=sys.stderr)
    sys.exit(2)

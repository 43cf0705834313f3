"""``ba-schema``: register protobuf message types for ClickHouse tables (placeholder
until the schema-registry issue lands)."""

import sys


def main() -> None:
    print("ba-schema: not implemented yet", file=sys.stderr)
    sys.exit(2)

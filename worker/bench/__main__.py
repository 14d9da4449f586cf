"""`python -m kvscale.worker.bench <benchmark> ... [--json]`: each benchmark prints one JSON object."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvscale.worker.bench import (
    broadcast,
    coldstart,
    hostile,
    load,
    longout,
    lora,
    membw,
    peer,
    probes,
    route,
    serve,
    spec,
    steps,
    structured,
    throughput,
    tp,
)


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    parser = argparse.ArgumentParser(prog="python -m kvscale.worker.bench")
    sub = parser.add_subparsers(dest="benchmark", required=True)
    throughput.add_parser(sub, [common])
    serve.add_parser(sub, [common])
    peer.add_parser(sub, [common])
    spec.add_parser(sub, [common])
    longout.add_parser(sub, [common])
    route.add_parser(sub, [common])
    probes.add_parser(sub, [common])
    structured.add_parser(sub, [common])
    tp.add_parser(sub, [common])
    broadcast.add_parser(sub, [common])
    steps.add_parser(sub, [common])
    hostile.add_parser(sub, [common])
    load.add_parser(sub, [common])
    coldstart.add_parser(sub, [common])
    lora.add_parser(sub, [common])
    membw.add_parser(sub, [common])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = args.func(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

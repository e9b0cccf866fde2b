"""``python -m speculant.entrypoints.openai.api_server``: vLLM's module entry point for the
OpenAI-compatible server, with the options of ``speculant serve`` (vLLM's spellings)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from speculant.cli import add_serve_arguments, cmd_serve, run

    parser = argparse.ArgumentParser(
        prog="python -m speculant.entrypoints.openai.api_server",
        description="OpenAI-compatible HTTP server with speculative decoding (same options as "
        "`speculant serve`)",
    )
    add_serve_arguments(parser)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO level and show full tracebacks"
    )
    parser.set_defaults(func=cmd_serve)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

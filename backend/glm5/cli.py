"""``glm5`` command line: each sub-command lives in its own module.

A sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; the module is
imported only when that command runs, so ``glm5 make-tiny`` does not pay for the engine import.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny": ("glm5.tiny_checkpoint", "write the tiny random GLM-5.3-Flash checkpoint"),
    "generate": ("glm5.entrypoints.generate", "generate text or token ids offline"),
    "serve": ("glm5.serving.launcher", "start tritonserver with the glm5 model repository"),
    "worker": ("glm5.entrypoints.worker", "run this machine's ranks of a multi-machine engine"),
    "check": ("glm5.entrypoints.check", "validate a checkpoint directory (config + safetensors headers)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="glm5", description="GLM-5.3-Flash engine and Triton serving tools")
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    # Only the chosen sub-command's module is imported; the others get a bare parser for --help.
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

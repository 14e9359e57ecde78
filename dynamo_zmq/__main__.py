"""``python -m dynamo_zmq TOOL [ARGS...]``: run one of the small tools.

    python -m dynamo_zmq quickstart      a frontend and a mocker worker on a tiny local model
    python -m dynamo_zmq status          list the live instances discovery finds
    python -m dynamo_zmq demo            a worker and a client in two processes, no HTTP
    python -m dynamo_zmq tiny-model DIR  build the tiny local model the tests and quickstart use
    python -m dynamo_zmq tiny-lora MODEL_DIR DIR
                                         build a random LoRA adapter for it (needs peft)
    python -m dynamo_zmq tiny-vlm DIR    build a tiny random LLaVA vision-language model

The processes a deployment runs have their own entry points: ``python -m dynamo_zmq.worker``
and ``python -m dynamo_zmq.frontend``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence


def _quickstart(argv: Sequence[str]) -> int:
    from .tools.quickstart import main

    return main(list(argv))


def _status(argv: Sequence[str]) -> int:
    from .tools.status import main

    return main(argv)


def _demo(argv: Sequence[str]) -> int:
    from .tools.demo import main

    return main(list(argv))


def _tiny_model(argv: Sequence[str]) -> int:
    from .tools.tiny_model import main

    main(list(argv))
    return 0


def _tiny_lora(argv: Sequence[str]) -> int:
    from .tools.tiny_lora import main

    main(list(argv))
    return 0


def _tiny_vlm(argv: Sequence[str]) -> int:
    from .tools.tiny_vlm import main

    main(list(argv))
    return 0


TOOLS: dict[str, Callable[[Sequence[str]], int]] = {
    "quickstart": _quickstart,
    "status": _status,
    "demo": _demo,
    "tiny-model": _tiny_model,
    "tiny-lora": _tiny_lora,
    "tiny-vlm": _tiny_vlm,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in TOOLS:
        unknown = bool(args) and args[0] not in ("-h", "--help")
        print(__doc__.strip(), file=sys.stderr if unknown else sys.stdout)
        if unknown:
            print(f"\nerror: unknown tool {args[0]!r}", file=sys.stderr)
            return 2
        return 0 if args else 2
    return TOOLS[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(main())

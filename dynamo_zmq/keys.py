"""``python -m dynamo_zmq.keys``: create and authorize CURVE keys (``dynamo_zmq.tools.keys``)."""

import sys

from .tools.keys import main

if __name__ == "__main__":
    sys.exit(main())

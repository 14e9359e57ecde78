"""``python -m dynamo_zmq.demo``: a worker and a client in two processes, no HTTP.

The same as ``python -m dynamo_zmq demo``; the tool lives in ``dynamo_zmq.tools.demo``.
"""

import sys

from .tools.demo import main

if __name__ == "__main__":
    sys.exit(main())

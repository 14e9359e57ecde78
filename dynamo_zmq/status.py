"""``python -m dynamo_zmq.status``: list the live instances discovery finds.

The same as ``python -m dynamo_zmq status``; the tool lives in ``dynamo_zmq.tools.status``.
"""

import sys

from .tools.status import main

if __name__ == "__main__":
    sys.exit(main())

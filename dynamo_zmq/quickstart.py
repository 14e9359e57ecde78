"""``python -m dynamo_zmq.quickstart``: a frontend and a mocker worker on a tiny local model.

The same as ``python -m dynamo_zmq quickstart``; the tool lives in ``dynamo_zmq.tools.quickstart``.
"""

import sys

from .tools.quickstart import main

if __name__ == "__main__":
    sys.exit(main())

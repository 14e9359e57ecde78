"""``python -m dynamo_zmq.worker``: see ``dynamo_zmq.worker``."""

import sys

from ._cli import main

sys.exit(main())

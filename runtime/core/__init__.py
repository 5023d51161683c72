"""The small shared core every part may import (issue 46): one copy of each mechanism.

- :mod:`.canonical`: canonical JSON and its sha256, the durable identity of requests,
  schemas, steps' arguments and datasets (a test pins the bytes);
- :mod:`.backoff`: exponential backoff, capped, with or without jitter;
- :mod:`.dberrors`: a database error told in one line.

It imports the standard library only, so importing it can never make a circle.
"""

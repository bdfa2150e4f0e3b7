"""What Django's cache writes to Redis: JSON, never pickles.

Django's Redis cache pickles by default, so anyone able to write to that Redis could run
code in every process that reads from it. JSON carries data only; what is cached must be
JSON-shaped (accounts.principals.KeyIdentity converts itself).
"""

from typing import Any

import orjson


class JSONSerializer:
    def dumps(self, value: Any) -> bytes:
        return orjson.dumps(value)

    def loads(self, data: bytes) -> Any:
        return orjson.loads(data)

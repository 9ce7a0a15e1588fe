"""Ray actor classes made on first use rather than at import.

`ray.remote(cls)` draws a random class id from Ray's generator, which is seeded once per process: forks of a
process that has drawn from it draw the same ids as one another afterwards (object and actor ids among them).
The warm interpreter (rlplatform.warm_start) imports the actors' modules before it forks Ray's workers, so those
modules define their actor classes as `LazyActorClass`es, which draw nothing until a job first starts one.
"""

from __future__ import annotations

from typing import Any, Optional

import ray
from ray.actor import ActorClass, ActorHandle


class LazyActorClass:
    """`ray.remote(**options)(cls)`, made when `options` or `remote` is first called."""

    def __init__(self, cls: type, **options: Any) -> None:
        self._cls = cls
        self._options = options
        self._made: Optional[ActorClass] = None

    def _actor_class(self) -> ActorClass:
        if self._made is None:
            self._made = ray.remote(**self._options)(self._cls) if self._options else ray.remote(self._cls)
        return self._made

    def options(self, **options: Any) -> Any:
        return self._actor_class().options(**options)

    def remote(self, *args: Any, **kwargs: Any) -> ActorHandle:
        return self._actor_class().remote(*args, **kwargs)


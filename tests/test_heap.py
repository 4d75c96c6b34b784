"""glm5.heap: a long-running engine process freezes its start-up objects, so a full garbage collection
walks only what requests allocated since."""

from __future__ import annotations

import gc

from glm5.heap import freeze_startup_heap, unfreeze_heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_start_up_heap_leaves_full_collections_only_new_objects():
    before = len(gc.get_objects())
    _Cycle()                                   # start-up garbage: collected before the freeze, not frozen
    try:
        frozen = freeze_startup_heap()
        assert frozen >= before // 2 and gc.get_freeze_count() > frozen - 100   # (frozen objects may still die)
        assert len(gc.get_objects()) < 1000     # a full collection now walks (almost) nothing
        assert not any(isinstance(o, _Cycle) for o in gc.get_objects())
        new = [_Cycle() for _ in range(5)]      # what requests allocate is still tracked and collected
        tracked = gc.get_objects()
        assert all(any(o is c for o in tracked) for c in new)
        del new, tracked
        assert gc.collect() >= 5
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) >= before // 2


def test_frozen_heap_block_unfreezes_after_an_error():
    from glm5.heap import frozen_heap

    try:
        with frozen_heap() as frozen:
            assert frozen > 0 and gc.get_freeze_count() > frozen - 100
            raise KeyError("inside the timed block")
    except KeyError:
        pass
    assert gc.get_freeze_count() == 0

"""shared/refs.py: a pooled buffer is free only while nothing but its pool and the caller's loop reference it."""
import numpy as np

from shared import refs


def free_in_loop(pool: list) -> list[bool]:
    return [refs.free(buf) for buf in pool]


def free_in_generator(pool: dict) -> bool:
    return all(refs.free(a) for a in pool.values())


def test_a_buffer_held_by_its_pool_alone_is_free_in_a_loop_and_a_generator():
    pool = [np.empty(64, np.uint8), bytearray(8)]
    assert free_in_loop(pool) == [True, True]
    assert free_in_generator({"a": pool[0]}) is False  # the list holds it too
    assert free_in_generator({"a": np.empty(4), "b": np.empty(4)}) is True


def test_a_view_or_another_name_makes_it_busy_until_it_goes():
    pool = [np.empty(64, np.uint8), np.empty(64, np.uint8), np.empty(64, np.uint8)]
    view, mv, name = pool[0][8:16], memoryview(pool[1]), pool[2]
    assert free_in_loop(pool) == [False, False, False]
    shaped = pool[0].view(np.float32).reshape(4, 4)
    del view, mv, name
    assert free_in_loop(pool) == [False, True, True]
    del shaped
    assert free_in_loop(pool) == [True, True, True]


def test_the_free_count_is_measured_on_this_python():
    assert isinstance(refs.FREE_COUNT, int) and refs.FREE_COUNT >= 1

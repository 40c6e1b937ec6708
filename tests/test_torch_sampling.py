"""syncps.sampling: each worker's shard of the round's global batch (numpy only: no torch needed)."""
import numpy as np

from syncps.sampling import RoundBatchSampler, round_batch, stream


def test_the_shards_of_a_round_concatenate_to_the_single_process_batch():
    n, b = 100, 7
    for workers in (1, 3, 4):
        for step in (0, 5, 40):
            shards = [round_batch(n, step, k, workers, b, seed=3) for k in range(workers)]
            np.testing.assert_array_equal(np.concatenate(shards), stream(n, step * workers * b, workers * b, seed=3))


def test_each_epoch_is_a_permutation_and_epochs_differ():
    n = 50
    first, second = stream(n, 0, n, seed=1), stream(n, n, n, seed=1)
    assert sorted(first) == sorted(second) == list(range(n))
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(stream(n, 45, 10, seed=1), np.concatenate([first[45:], second[:5]]))
    np.testing.assert_array_equal(stream(n, 0, 7, shuffle=False), np.arange(7))


def test_the_sampler_reshards_when_the_round_changes():
    state = {"round": (0, 1, 4)}
    sampler = iter(RoundBatchSampler(lambda: state["round"], 1000, 8, seed=2))
    assert next(sampler) == round_batch(1000, 0, 1, 4, 8, seed=2).tolist()
    state["round"] = (1, 1, 4)
    assert next(sampler) == round_batch(1000, 1, 1, 4, 8, seed=2).tolist()
    state["round"] = (2, 0, 3)  # a worker left: 3 shards from step 2 on
    assert next(sampler) == round_batch(1000, 2, 0, 3, 8, seed=2).tolist()
    state["round"] = None
    assert next(sampler, "end") == "end"


def test_a_prefetching_loader_gets_the_next_steps_and_a_restarted_ps_is_followed():
    state = {"round": (10, 0, 2)}
    sampler = iter(RoundBatchSampler(lambda: state["round"], 1000, 4))
    ahead = [next(sampler) for _ in range(3)]  # asked before the PS moved: steps 10, 11, 12
    assert ahead == [round_batch(1000, s, 0, 2, 4).tolist() for s in (10, 11, 12)]
    state["round"] = (11, 0, 2)
    assert next(sampler) == round_batch(1000, 13, 0, 2, 4).tolist()
    state["round"] = (5, 0, 2)  # restarted from an older checkpoint
    assert next(sampler) == round_batch(1000, 5, 0, 2, 4).tolist()

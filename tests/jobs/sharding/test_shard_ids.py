"""finalize's shared-id check (jobs/sharding/shard_ids.py): ids spilled to hash buckets on disk, one shard at a time."""

from __future__ import annotations

from batchgen.jobs.sharding.shard_ids import SharedIdCheck


def test_disjoint_shards_share_nothing_and_the_spill_is_removed():
    with SharedIdCheck(3000, bucket_ids=100) as check:
        assert check.num_buckets == 30
        for shard in range(3):
            check.add(shard, range(shard * 1000, (shard + 1) * 1000))
        assert check.first_shared() is None
        assert len(check.files) > 1 and check.directory.is_dir()
    assert not check.directory.exists()


def test_an_id_in_two_shards_is_found_whatever_its_type():
    for ids, shared in (([1, 2, 3], 3), (["a:0", "b\n1", "ü"], "b\n1"), ([10.5, 2.0], 2.0)):
        with SharedIdCheck(len(ids) * 2, bucket_ids=2) as check:
            check.add(0, ids)
            check.add(1, [shared, "other"])
            assert check.first_shared() == (shared, 0, 1)


def test_one_shard_alone_never_collides_with_itself():
    with SharedIdCheck(10) as check:
        check.add(4, range(10))
        check.add(5, range(10, 20))
        assert check.first_shared() is None

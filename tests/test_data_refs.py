"""The driver hands references, the ranks fetch: what a rank assembles from its share is exactly
its slice of the global batch the driver would have relayed, at any world size, while the world
(and so the way pieces are cut) changes mid-stream, and after a seek."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_sys.data.plane import DataPlane
from raytrain_sys.data.prepare import prepare_text_dataset
from raytrain_sys.data.shards import read_manifest
from raytrain_sys.parallel.mesh import rank_data_slices
from raytrain_sys.spec import ParallelSpec
from raytrain_sys.train.tasks import NextToken

pytestmark = pytest.mark.warm_workers  # passes on warm spares too: RTS_TESTS_WARM_WORKERS=1 (conftest.py)

B = 24


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("refs") / "tokens")
    prepare_text_dataset(out, row_len=33, rows_per_shard=64, max_bytes=40_000)
    return out


def test_each_ranks_share_equals_its_slice_of_the_relayed_batch(ray_cluster, dataset):
    m = read_manifest(dataset)
    steps = 2 * m.num_rows // B
    kw = dict(end_position=steps * B, prefetch_steps=2, task=NextToken())
    refs_plane = DataPlane(dataset, m, 3, 128, 16, B, **kw)
    relay_plane = DataPlane(dataset, m, 3, 128, 16, B, **kw)
    worlds = [2, 3, 1, 4]
    try:
        for step in range(steps):
            world = worlds[(step // 7) % len(worlds)]  # a resize every 7 steps
            shares = rank_data_slices(ParallelSpec(), world, B)
            refs_plane.share_rows = max(s.stop - s.start for s in shares)
            if step == steps // 2:  # a seek: back to an earlier cursor, then on from there
                refs_plane.global_batch_refs(B)
            batch = refs_plane.global_batch_refs(step * B)
            rows, ids = relay_plane.global_batch(step * B)
            np.testing.assert_array_equal(batch.ids, ids)
            assert batch.units == NextToken().units(rows)
            for sl in shares:
                got, _ = batch.share(sl).fetch()
                np.testing.assert_array_equal(got["tokens"], rows["tokens"][sl],
                                              err_msg=f"step {step}, world {world}, rows {sl}")
    finally:
        refs_plane.close()
        relay_plane.close()


def test_read_resources_place_the_reads_on_the_nodes_that_offer_them(ray_nodes, dataset):
    """data.read_resources moves reading (and decoding) to the nodes that offer the resource,
    e.g. CPU-only nodes; the ranks then fetch from there."""
    node = ray_nodes.add_node(num_cpus=0, resources={"data_reader": 4}, **ray_nodes.node_args)
    ray_nodes.wait_for_nodes()
    try:
        m = read_manifest(dataset)
        plane = DataPlane(dataset, m, 0, 128, 16, B, end_position=m.num_rows // B * B,
                          read_resources={"data_reader": 1})
        try:
            for step in range(m.num_rows // B):
                plane.global_batch(step * B)
        finally:
            plane.close()
        assert set(plane.read_nodes) == {node.node_id}, plane.read_nodes
        assert sum(plane.read_nodes.values()) >= 2  # several chunks, all read there
    finally:
        ray_nodes.remove_node(node)
        ray_nodes.wait_for_nodes()


def test_a_jobs_first_read_in_the_driver_deals_the_same_rows_as_read_tasks(ray_cluster, dataset):
    """A job's first read is made in the driver (its reader processes are not up yet), the
    reads after it by read tasks: the same rows, in the same order, as a plane that reads
    everything in tasks, across the first chunk's end and a seek back into it."""
    m = read_manifest(dataset)
    steps = m.num_rows // B + 3
    kw = dict(end_position=2 * steps * B, prefetch_steps=2, task=NextToken())
    here, tasks = DataPlane(dataset, m, 5, 128, 16, B, **kw), DataPlane(dataset, m, 5, 128, 16, B, **kw)
    here.read_first_here = True
    try:
        for step in [*range(steps), 1, 2]:  # then a seek back into the first chunk
            batch = here.global_batch_refs(step * B)
            rows, ids = tasks.global_batch(step * B)
            np.testing.assert_array_equal(batch.ids, ids, err_msg=f"step {step}")
            got, _ = batch.share(slice(0, B)).fetch()
            np.testing.assert_array_equal(got["tokens"], rows["tokens"], err_msg=f"step {step}")
        assert here.reads_here == 1 and tasks.reads_here == 0
    finally:
        here.close()
        tasks.close()


def test_the_depth_a_lease_is_sized_by_counts_the_reads_finished_behind_the_one_taken(ray_cluster, dataset):
    """A read is taken when a batch needs it, so the rows taken end where the chunk in use
    does; the reads after it that have finished count too (an automatic lease would otherwise
    end at every chunk's end), and the batches they hold are the stream's, as any."""
    from tests.ft_common import wait_until

    m = read_manifest(dataset)
    steps = 2 * m.num_rows // B
    kw = dict(end_position=steps * B, prefetch_steps=2, task=NextToken())
    plane, reference = DataPlane(dataset, m, 3, 128, 16, B, **kw), DataPlane(dataset, m, 3, 128, 16, B, **kw)
    try:
        plane.global_batch_refs(0)  # the first chunk (one window) taken, the next reads submitted
        taken = plane.rows_ahead(0)
        assert 0 < taken < steps * B
        assert wait_until(lambda: plane.rows_ahead(0, finished_reads=True) > taken, 60)
        ready = plane.rows_ahead(0, finished_reads=True)
        assert plane.rows_ahead(0) == taken  # counting took nothing
        for step in range(ready // B):
            np.testing.assert_array_equal(plane.global_batch_refs(step * B).ids,
                                          reference.global_batch(step * B)[1], err_msg=f"step {step}")
        assert plane.rows_ahead(0) >= ready  # the finished reads were taken as planned
    finally:
        plane.close()
        reference.close()

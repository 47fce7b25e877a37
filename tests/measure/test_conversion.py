"""fastdata.measure.conversion: a folder's disk use and a process tree's memory, sampled while a real process runs."""

import os
import signal
import sys
import textwrap
from functools import partial

import pytest

from fastdata.converters import find_images
from fastdata.measure.baselines import plain_pool, pooled
from fastdata.measure.conversion import count_shards, folder_usage, pool_decode_count, run_watched, tree_rss
from fastdata.measure.synthetic import make_imagefolder

pytest.importorskip("psutil")

PARENT_AND_CHILD = textwrap.dedent("""
    import subprocess, sys
    code = "import sys; b = bytes(range(256)) * (256 << 10); print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)  # 64 MB, every page written
    sys.stdin.read()  # until the test closes stdin
    child.stdin.close()
    child.wait()
""")

# A partial file of 4 MB is written, kept 1 s, removed; then the final 1 MB file.
PARTIAL_THEN_FINAL = textwrap.dedent("""
    import os, sys, time
    folder = sys.argv[1]
    os.makedirs(folder)
    with open(os.path.join(folder, ".shard-00000.partial.h5"), "wb") as f:
        f.write(os.urandom(4 << 20))
    time.sleep(1.0)
    os.remove(os.path.join(folder, ".shard-00000.partial.h5"))
    with open(os.path.join(folder, "shard-00000.h5"), "wb") as f:
        f.write(os.urandom(1 << 20))
    print('{"done": 1}')
""")

SHARD_EVERY_50_MS = textwrap.dedent("""
    import os, sys, time
    folder = sys.argv[1]
    os.makedirs(folder)
    for k in range(200):
        open(os.path.join(folder, f"shard-{k:05d}.h5"), "wb").close()
        time.sleep(0.05)
""")


def test_folder_usage_counts_hidden_and_nested_files(tmp_path):
    (tmp_path / ".fastdata").mkdir()
    (tmp_path / ".fastdata" / "shard-00000.json").write_bytes(b"x" * 100)
    (tmp_path / ".shard-00001.abc.partial.h5").write_bytes(b"y" * 5000)
    (tmp_path / "shard-00000.h5").write_bytes(b"z" * 70000)
    size, allocated = folder_usage(tmp_path)
    assert size == 75100
    assert allocated >= 70000  # whole blocks of each file
    assert folder_usage(tmp_path / "not-there") == (0, 0)


def test_folder_usage_allocated_leaves_out_the_holes_of_sparse_files(tmp_path):
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(64 << 20)
    size, allocated = folder_usage(tmp_path)
    assert size == 64 << 20 and allocated < 1 << 20


@pytest.mark.integration
def test_tree_rss_reads_the_process_and_its_descendants():
    import subprocess

    with subprocess.Popen([sys.executable, "-c", PARENT_AND_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as process:
        assert process.stdout.readline().strip() == "ready"
        own, children = tree_rss(process.pid)
        process.stdin.close()
        process.wait(30)
    assert own > 1 << 20 and len(children) == 1 and children[0] >= 64 << 20
    assert tree_rss(process.pid) == (None, [])


@pytest.mark.slow
def test_run_watched_sees_the_partial_file_at_its_peak(tmp_path):
    folder = tmp_path / "out"
    watched = run_watched([sys.executable, "-c", PARTIAL_THEN_FINAL, str(folder)], str(folder), timeout=60)
    assert watched.returncode == 0 and watched.json() == {"done": 1} and not watched.killed
    assert watched.peaks.disk_bytes >= (4 << 20) and watched.peaks.disk >= (4 << 20)
    assert folder_usage(folder)[0] == 1 << 20
    assert watched.peaks.driver_rss > 1 << 20 and watched.peaks.descendants == 0
    assert watched.peaks.readings >= 3 and watched.seconds >= 1.0


def test_run_watched_kills_the_process_group_when_asked(tmp_path):
    folder = tmp_path / "out"
    watched = run_watched([sys.executable, "-c", SHARD_EVERY_50_MS, str(folder)], str(folder),
                          kill_when=lambda root: count_shards(root, ".h5") >= 3, timeout=60)
    assert watched.killed and watched.returncode == -signal.SIGKILL
    assert 3 <= count_shards(folder, ".h5") < 200


def test_count_shards_counts_finished_shards_of_one_extension(tmp_path):
    for name in ("shard-00000.h5", "shard-00001.h5", ".shard-00002.x.partial.h5", "shard-00000.arrow", "index.json"):
        (tmp_path / name).touch()
    assert count_shards(tmp_path, ".h5") == 2 and count_shards(tmp_path, ".arrow") == 1
    assert count_shards(tmp_path / "missing", ".h5") == 0


def _sigterm_is_default(_):
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_plain_pool_processes_end_on_sigterm_under_a_parent_handler_that_returns():
    # NOTE [forked SIGTERM] in fastdata/measure/limits.py: the autouse restore_sigterm fixture puts it back
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    with plain_pool(2) as pool:
        assert all(pool.map(_sigterm_is_default, range(8), chunksize=1))


def _touch_or_fail(folder, item):
    (folder / str(item)).touch()
    if item % 7 == 3:
        raise ValueError(f"item {item}")
    return item


@pytest.mark.parametrize("ordered", [True, False])
def test_a_pooled_error_is_raised_once_every_item_is_done(tmp_path, ordered):
    # NOTE [pool errors at the end] in baselines.py: the pool is left only when its workers are idle
    with plain_pool(2) as pool:
        done = []
        with pytest.raises(ValueError, match="item 3" if ordered else "item"):
            for value in pooled(pool, partial(_touch_or_fail, tmp_path), range(40), 1, ordered=ordered):
                done.append(value)
    assert sorted(int(path.name) for path in tmp_path.iterdir()) == list(range(40))  # every item ran
    assert sorted(done) == [item for item in range(40) if item % 7 != 3]


def test_pool_decode_count_decodes_every_image(tmp_path):
    root = make_imagefolder(tmp_path / "photos", 2, 5, size=(120, 90), vary=True, jpeg_only=True)
    _, relpaths, _ = find_images(root)
    assert pool_decode_count([os.path.join(root, p) for p in relpaths], 32, workers=2) == 10
    assert pool_decode_count([os.path.join(root, p) for p in relpaths], 32, workers=2, quality=90) == 10
    (tmp_path / "photos" / "class_0" / "img_00000.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(OSError):
        pool_decode_count([os.path.join(root, p) for p in relpaths], 32, workers=2)

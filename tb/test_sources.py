"""tb/sources.py: the record of what a build was made from. Pure Python (no simulator)."""
import os
import time

from tb import sources as build_sources


def test_process_start_is_this_process():
    started = build_sources.process_start()
    assert started <= time.time()
    # pytest imported this module after it started, and it has not run for a day.
    assert started <= build_sources._IMPORTED and started > time.time() - 86400


def test_process_start_to_a_clock_tick():
    """A process started now starts now, not up to a second before (/proc/stat's whole-second
    btime did that, and files checked out just before a run then counted as written during it)."""
    import subprocess
    import sys
    before = time.time()
    printed = subprocess.run([sys.executable, "-c", "from tb.sources import process_start; "
                              "print(repr(process_start()))"], capture_output=True, text=True,
                             check=True, cwd=build_sources.REPO).stdout
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - 2 * tick <= float(printed) <= time.time()


def sources(tmp_path, age):
    for tree in build_sources.SOURCE_TREES:
        (tmp_path / tree).mkdir()
        source = tmp_path / tree / "block.py"
        source.write_text(f"# {tree}\n")
        moment = time.time() + age
        os.utime(source, (moment, moment))
    return tmp_path


def test_a_build_is_stamped_with_its_sources(tmp_path):
    root = sources(tmp_path, age=-3600)
    stamp = tmp_path / ".source_digest"
    digest = build_sources.source_digest(root=root)
    build_sources.stamp_sources(stamp, digest, root=root)
    assert stamp.read_text() == digest
    (root / "hdl" / "block.py").write_text("# changed\n")
    assert build_sources.source_digest(root=root) != digest


def test_sources_written_after_the_process_started_leave_no_stamp(tmp_path):
    """The process may have imported the older file: the next run must build again."""
    root = sources(tmp_path, age=-3600)
    stamp = tmp_path / ".source_digest"
    stamp.write_text("an older build's digest")
    moment = build_sources.process_start() + 1
    os.utime(root / "models" / "block.py", (moment, moment))
    assert build_sources.sources_changed_since(build_sources.process_start(), root=root) == \
        [root / "models" / "block.py"]
    build_sources.stamp_sources(stamp, build_sources.source_digest(root=root), root=root)
    assert not stamp.exists()

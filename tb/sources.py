"""The repository, its build tree, and the digest of the Python a design is built from:
a build is made again only when that digest changes (tb/runner.py, tb/hier_build.py)."""
import hashlib
import os
import time
from pathlib import Path

__all__ = ["REPO", "BUILD", "SOURCE_TREES", "source_digest", "sources_changed_since",
           "stamp_sources"]

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build" / "tb"

SOURCE_TREES = ("hdl", "models", "tb")     # the Python a design can be shaped by


def source_digest(trees=SOURCE_TREES, root=REPO):
    """Digest of every Python file under ``trees`` (folders of ``root``)."""
    digest = hashlib.sha1()
    for top in trees:
        for path in sorted((root / top).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def process_start():
    """When this process started, in ``time.time()`` seconds (Linux, to a clock tick);
    elsewhere, when this module was imported. Its age is taken on the boot clock, which
    its start time counts on: /proc/stat's ``btime`` is whole seconds (and drifts from
    ``time.time()`` with clock corrections), which put the start up to a second early, so
    that files checked out a moment before the run counted as written during it and no
    build was stamped."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")   # field 22, starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


_IMPORTED = time.time()


def sources_changed_since(moment, trees=SOURCE_TREES, root=REPO):
    """The Python files under ``trees`` (folders of ``root``) written after ``moment``."""
    return [path for top in trees for path in sorted((root / top).rglob("*.py"))
            if path.stat().st_mtime > moment]


def stamp_sources(stamp, digest, root=REPO):
    """Record in ``stamp`` that a build was made from the sources ``digest`` describes,
    unless one of them was written after this process started: what it imported may be
    older than the digest says, so the next run builds again."""
    if sources_changed_since(process_start(), root=root):
        stamp.unlink(missing_ok=True)
    else:
        stamp.write_text(digest)

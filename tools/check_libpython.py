"""Fail with one clear line when the embeddable libpython cocotb needs is absent."""
import os
import sys
import sysconfig

libdir = sysconfig.get_config_var("LIBDIR") or ""
ldlibrary = sysconfig.get_config_var("LDLIBRARY") or ""
instsoname = sysconfig.get_config_var("INSTSONAME") or ""
candidates = [os.path.join(libdir, name) for name in (instsoname, ldlibrary) if name.endswith(".so") or ".so." in name]
if not any(os.path.exists(path) for path in candidates):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    print(f"error: shared libpython{version} not found (cocotb embeds Python in the simulator): "
          f"apt-get install libpython{version}")
    sys.exit(1)

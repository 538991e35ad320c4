"""Packs the venv's site-packages (the `mcp` SDK and what it imports) as a
tar.gz for a guest: Debian 12 with the same python 3.11 and architecture
as the host, so the compiled wheels (pydantic_core, rpds) run there.

    python pack_site.py OUT.tgz
"""
import os
import sys
import sysconfig
import tarfile

SKIP = {"pip", "setuptools", "pkg_resources", "_distutils_hack", "cryptography",
        "cffi", "pycparser", "__pycache__", "distutils-precedence.pth"}

site = sysconfig.get_paths()["purelib"]
with tarfile.open(sys.argv[1], "w:gz") as t:
    for name in sorted(os.listdir(site)):
        if name in SKIP or name.split("-")[0] in SKIP:
            continue
        t.add(os.path.join(site, name), arcname=name,
              filter=lambda i: None if "__pycache__" in i.name else i)

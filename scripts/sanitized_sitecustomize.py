"""sitecustomize for scripts/with_sanitizers.sh: ortbridge._C comes from the sanitized build.

The editable install puts its finder on sys.meta_path from a .pth file, ahead of the PYTHONPATH
search, so a PYTHONPATH entry alone does not win. Python imports sitecustomize after the .pth
files, so a finder put first here is asked first. The wrapper copies this file into
build/sanitized/pyshim/ and names the module in ORTBRIDGE_SANITIZED_C; child processes inherit
both (not under python -I or -S, which skip PYTHONPATH or site).
"""

import os
import sys


class _SanitizedC:
    def __init__(self, path):
        self.path = path

    def find_spec(self, name, path=None, target=None):
        if name != "ortbridge._C":
            return None
        import importlib.machinery
        import importlib.util

        loader = importlib.machinery.ExtensionFileLoader(name, self.path)
        return importlib.util.spec_from_file_location(name, self.path, loader=loader)


def _chain():
    # This file shadows any other sitecustomize on the path: run that one too.
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("ORTBRIDGE_SANITIZED_C"):
    sys.meta_path.insert(0, _SanitizedC(os.environ["ORTBRIDGE_SANITIZED_C"]))
_chain()

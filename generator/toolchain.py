"""The CUDA compiler the build uses, found and checked before anything is compiled, so that a missing or broken
nvcc is one line naming what to install or set rather than a traceback from deep inside CuPy."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

INSTALL_HINT = ("install the CUDA toolkit (nvcc, CUDA 13) and put its bin/ on PATH, or set NVCC=/path/to/nvcc "
                "(or CUDA_PATH=/path/to/cuda)")


class ToolchainError(RuntimeError):
    """No usable nvcc; the message is one line that says what to install or set."""


_found: dict[str, str] = {}


def find_nvcc() -> str:
    """Path of the nvcc that CuPy will compile with (the `NVCC` environment variable, else CuPy's search of PATH,
    CUDA_PATH and /usr/local/cuda), after checking that `nvcc --version` runs.

    Returns the command as CuPy will run it (a path; `NVCC` may be a command line such as "ccache nvcc").
    Raises ToolchainError (one line) when none is found, `NVCC` is set to something that does not exist or is not
    executable, or `nvcc --version` fails. The result is cached per value of `NVCC`."""
    env = os.environ.get("NVCC")
    if env in _found:
        return _found[env]
    if env is not None:
        words = shlex.split(env)
        if not words:
            raise ToolchainError(f"NVCC is set but empty: unset it or set NVCC=/path/to/nvcc ({INSTALL_HINT})")
        exe = words[-1] if os.path.basename(words[0]) in ("ccache", "sccache") and len(words) > 1 else words[0]
        if shutil.which(exe) is None:
            raise ToolchainError(f"NVCC={env}: '{exe}' is not an executable file; set NVCC to the path of nvcc "
                                 "or unset it to search PATH and /usr/local/cuda")
        cmd, source = words, f"NVCC={env}"
    else:
        try:
            from cupy.cuda import get_nvcc_path
            path = get_nvcc_path()
        except ImportError:
            raise ToolchainError(f"CuPy is not installed: pip install cupy-cuda13x, and {INSTALL_HINT}") from None
        except Exception:  # noqa: BLE001 - a broken CUDA search is the same for the user: no nvcc
            path = None
        if not path:
            raise ToolchainError(f"nvcc not found: {INSTALL_HINT}")
        cmd, source = [path], path
    try:
        r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolchainError(f"{source}: `nvcc --version` failed ({type(exc).__name__}: {exc}); {INSTALL_HINT}")
    if r.returncode != 0 or "release" not in r.stdout:
        first = (r.stderr.strip() or r.stdout.strip() or f"exit {r.returncode}").splitlines()[0][:200]
        raise ToolchainError(f"{source}: `nvcc --version` failed ({first}); {INSTALL_HINT}")
    _found[env] = " ".join(cmd)
    return _found[env]


# the tensor-core instructions counted in a kernel's SASS: legacy warp-level mma (HMMA), Hopper's warpgroup mma
# (HGMMA), and the shared-memory matrix loads that feed them (LDSM)
SASS_OPS = ("HMMA", "HGMMA", "LDSM")


def find_cuda_tool(name: str) -> str | None:
    """Path of a CUDA binary tool (cuobjdump, nvdisasm): PATH, the toolkit beside nvcc, or the pip wheels'
    nvidia/cu13/bin (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm); None where there is none."""
    found = shutil.which(name)
    if found:
        return found
    dirs = [os.path.join(os.environ.get("CUDA_PATH", "/usr/local/cuda"), "bin")]
    try:
        import nvidia
        dirs += [os.path.join(p, sub, "bin") for p in nvidia.__path__ for sub in ("cu13", "cuda_cuobjdump",
                                                                                 "cuda_nvdisasm")]
    except ImportError:
        pass
    for d in dirs:
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return None


def sass_counts(cubin: str) -> dict[str, int] | None:
    """Static count of each SASS_OPS instruction in a cubin (cuobjdump -sass; it needs nvdisasm beside it or on
    PATH); None where the tools are absent or fail (the report then shows "-")."""
    tool, disasm = find_cuda_tool("cuobjdump"), find_cuda_tool("nvdisasm")
    if tool is None or disasm is None:
        return None
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(disasm), os.environ.get("PATH", "")]))
    try:
        r = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    import re
    ops = re.findall(r"\b(" + "|".join(SASS_OPS) + r")\b", r.stdout)
    return {op: ops.count(op) for op in SASS_OPS}


def descendants(pid: int) -> list[int]:
    """The process ids of `pid`'s running children, theirs, and so on (zombies left out), read from Linux's /proc (the
    compilers CuPy starts for a build's worker threads); [] where /proc is absent (another OS)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            state, ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]  # fields 3 and 4, after "(comm)"
            ppid = int(ppid)
        except (OSError, ValueError, IndexError):  # a process that ended meanwhile
            continue
        if state == "Z":  # exited, awaiting its reaper: nothing left to stop
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out

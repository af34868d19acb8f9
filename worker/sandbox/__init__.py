"""Run one tool call in a sandbox: least rights, bounded resources, killed as a whole.

Three layers; ``docs/sandbox.md`` says what each stops and what it does not.

- ``fork`` (the default for ``@tool`` functions; a fork + ~1.5 ms CPU): a fresh child
  per call in its own session; cwd = the run's folder; environment reduced to an
  allowlist; every inherited descriptor but the result pipe pointed at /dev/null;
  rlimits (CPU soft < hard, address space, file size, open files, processes);
  ``no_new_privs``; and when the worker is root, a uid of its own
  (``UID_BASE + n``, from a host-wide counter) in the run's group (the folder is ``root:<gid> 2770``), so
  RLIMIT_NPROC bounds it and ``kill(-1)`` as that uid ends exactly its processes.
- ``exec``: strict calls without bubblewrap: the same, but the tool runs in a fresh
  interpreter (no copy of the worker's memory), which drops to the call's uid
  after importing the tool's module.
- ``bwrap``: that interpreter inside bubblewrap: read-only root, the run folder the
  only writable path, private /tmp and /run, other runs hidden, no network (unless
  the policy allows it), its own pid namespace, dead with the worker.

``TOOLOOP_SANDBOX``: ``auto`` (strict tools in bwrap when it works here, the rest
forked), ``bwrap`` (every call in bwrap; calls are refused if it does not work),
``basic`` (never bwrap). Whatever the layer, the call's process tree is killed at
the deadline or when ``on_tick`` says the run is over.

Modules, in the order a call meets them: ``plan`` (its layer, folder, environment and
bwrap command line, from ``host`` and ``folders``), ``call`` (the worker's side: start,
watch, kill, reap, decode), ``child`` (the call's own process), ``runner`` (the exec
layers' fresh interpreter), ``spare`` (the next call's process, forked ahead;
``spare_child``: that process's own side), ``reuse`` (a spare kept for the run's next
call), ``zygote`` (the fork server that forks it, so that the worker does not),
``reaper`` (orphans and uids), ``kernel`` (Landlock and seccomp), ``quota`` (the run
folder's disk quota), ``env`` (the environment allowlist), ``forget`` (what a forked
call drops of the worker's state); ``constants``, ``context``, ``paths`` and ``libc``
hold what they say.
"""

from worker.sandbox import reuse
from worker.sandbox.call import run_call
from worker.sandbox.command import Command, sandboxed_command
from worker.sandbox.constants import MODES, UID_BASE, UID_SPAN
from worker.sandbox.context import CallOutcome, SandboxContext, SandboxError, jsonable
from worker.sandbox.host import Host, layer_reasons, layers
from worker.sandbox.spare import settle

__all__ = [
    "MODES",
    "UID_BASE",
    "UID_SPAN",
    "CallOutcome",
    "Command",
    "Host",
    "SandboxContext",
    "SandboxError",
    "jsonable",
    "layer_reasons",
    "layers",
    "reuse",
    "run_call",
    "sandboxed_command",
    "settle",
]

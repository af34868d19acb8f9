"""The sandbox's numbers and names: deadlines, descriptors, uid and gid ranges, paths."""

MODES = ("auto", "bwrap", "basic")
TICK_S = 0.25  # heartbeat / abort check while a call runs
EXIT_GRACE_S = 1.0  # a call that reported may take this long to exit before it is killed
SWEEP_S = 1.0  # bound on killing and reaping what a call left behind
RESULT_FD = 3  # where the call writes its framed JSON result
REQUEST_FD = 4  # where a spare process waits for its call (see _Spare)
MAX_RESULT_BYTES = 16 << 20
STARTED_MARK = "\n[tooloop: the tool started]\n"  # the runner's, on its stderr pipe (runner.py)
FAILED_START = "failed_start"  # a result's mark: the sandbox, not the tool, failed (the log says it once)
UID_BASE = 0x7000_0000  # per-call uids: UID_BASE + n, n from a host-wide counter (never reused with pids)
UID_SPAN = 1 << 24  # up to GID_BASE
UID_BLOCK = 64  # uids a process takes from the counter at once (one flock per 64 calls)
GID_BASE = 0x7100_0000  # per-run groups: GID_BASE + 1 .. GID_BASE + GID_SPAN
GID_SPAN = 1 << 24
STATE_DIR = "/var/lib/tooloop"  # host-wide counters and run groups (fallback: <sandbox root>/.state)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_PASSTHROUGH = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
ALLOWED_COMMANDS_ENV = "TOOLOOP_ALLOWED_COMMANDS"  # read by the shell built-in (worker/shell_policy.py)
EXECUTORS_ENV = "TOOLOOP_SHELL_EXECUTORS"  # the operator's opt-in, passed to the shell built-in

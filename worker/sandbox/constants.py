"""The sandbox's numbers and names: deadlines, descriptors, uid and gid ranges, paths."""

MODES = ("auto", "bwrap", "basic")
TICK_S = 0.25  # heartbeat / abort check while a call runs
EXIT_GRACE_S = 1.0  # a call that reported may take this long to exit before it is killed
SWEEP_S = 1.0  # bound on killing and reaping what a call left behind
RESULT_FD = 3  # where the call writes its framed JSON result
REQUEST_FD = 4  # where a spare process waits for its call (see _Spare)
MAX_RESULT_BYTES = 16 << 20
UID_BASE = 0x7000_0000  # per-call uids: UID_BASE + pid (pid_max <= 2**22)
UID_SPAN = 1 << 22
GID_BASE = 0x7100_0000  # per-run groups: GID_BASE + 1 .. GID_BASE + GID_SPAN
GID_SPAN = 1 << 24
GID_COUNTER = "/var/lib/tooloop/gid-counter"  # host-wide, so runs of all deployments differ
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV_PASSTHROUGH = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")
ALLOWED_COMMANDS_ENV = "TOOLOOP_ALLOWED_COMMANDS"  # read by the shell built-in

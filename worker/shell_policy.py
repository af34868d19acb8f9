"""The ``shell`` tool's command allowlist (``sandbox.allowed_commands``): a policy, not a
boundary.

It says which programs a run may start; the sandbox (its own uid, Landlock, seccomp,
bubblewrap) is what bounds what they can do. Still, an allowlist that lets ``find`` run
``find -exec sh -c …`` allows everything, so the policy refuses:

- programs that execute their arguments or a script (interpreters, ``env``, ``xargs``,
  ``make``, ``ssh``...), unless the operator lists them in ``TOOLOOP_SHELL_EXECUTORS``;
- the executing options of the others: ``find -exec/-execdir/-ok/-okdir``; ``tar
  --to-command``, ``--use-compress-program``/``-I``, ``--checkpoint-action``,
  ``--info-script``/``-F``, ``--new-volume-script``, ``--rsh-command``; ``git -c``,
  ``--exec-path``, ``--upload-pack``, ``rebase --exec``, ``config``, ``submodule``...;
- and runs ``sed`` and ``gawk`` in their own ``--sandbox`` mode (no ``e`` command, no
  ``s///e``, no ``system()``, no pipes to commands), ``git`` without system or global
  config, hooks or fsmonitor, and only in a repository whose own config holds no key
  that names a command; ``curl``/``wget`` without their config files (``HOME`` is the
  run's folder, where the model writes).

Standard library only: this runs inside the sandbox.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess

ALLOWED_COMMANDS_ENV = "TOOLOOP_ALLOWED_COMMANDS"  # set by the sandbox from the run's policy
EXECUTORS_ENV = "TOOLOOP_SHELL_EXECUTORS"  # set by the sandbox from the operator's setting


class CommandRefused(ValueError):
    """A shell command outside the run's command allowlist, or using an executing option."""


# Programs that run code they are given (an argument, a file of the run's folder, a config).
EXECUTORS = frozenset({
    "sh", "bash", "dash", "zsh", "ksh", "mksh", "csh", "tcsh", "fish", "busybox", "toybox",
    "env", "xargs", "parallel", "make", "gmake", "cmake", "ninja", "nice", "nohup", "timeout", "stdbuf",
    "setsid", "setpriv", "chroot", "sudo", "su", "doas", "runuser", "time", "watch", "strace", "ltrace",
    "gdb", "script", "expect", "flock", "unshare", "nsenter", "taskset", "ionice", "chrt", "systemd-run",
    "at", "batch", "crontab", "exec", "eval", "command", "builtin", "mawk", "nawk", "original-awk",
    "ssh", "scp", "sftp", "rsync", "vi", "vim", "nvim", "view", "ex", "ed", "emacs", "nano", "less", "more",
    "man", "pip", "pip3", "npm", "npx", "yarn", "pnpm", "cargo", "go", "gcc", "cc", "g++", "c++", "clang",
    "ld", "zip", "openssl", "dpkg", "apt", "apt-get", "docker", "kubectl", "tooloop", "celery",
    "jupyter", "ipython", "R", "Rscript", "julia", "node", "nodejs", "deno", "bun", "osascript",
})  # fmt: skip
_VERSIONED = re.compile(r"(python|pypy|perl|ruby|php|lua|luajit|tclsh|wish|node|pip)[0-9.]*")

_FIND = {"-exec", "-execdir", "-ok", "-okdir"}
_TAR_LONG = ("to-command", "use-compress-program", "checkpoint-action", "info-script",
             "new-volume-script", "rsh-command", "rmt-command")  # fmt: skip
_GIT_GLOBAL = ("config-env", "exec-path", "git-dir", "work-tree", "namespace", "super-prefix",
               "list-cmds")  # fmt: skip
_GIT_REFUSED = {"config", "submodule", "bisect", "filter-branch", "difftool", "mergetool", "instaweb",
                "daemon", "send-email", "web--browse", "help", "credential", "upload-pack", "receive-pack",
                "shell", "archimport", "cvsimport", "cvsserver", "svn", "p4", "quiltimport", "remote-ext",
                "remote-fd", "fsmonitor--daemon", "hook", "am", "notes", "replace"}  # fmt: skip
_GIT_LONG = ("exec", "upload-pack", "receive-pack", "extcmd", "open-files-in-pager", "ext-diff",
             "textconv", "tool", "template", "separate-git-dir", "config")  # fmt: skip
_GIT_SHORT = {"rebase": "x", "clone": "uc", "fetch": "u", "pull": "u", "ls-remote": "u", "archive": "",
              "grep": "O", "init": "", "push": ""}  # fmt: skip
# Only these keys may be in a repository's own config: none of them names a command.
_GIT_SAFE_KEYS = re.compile(
    r"(core\.(repositoryformatversion|filemode|bare|logallrefupdates|ignorecase|precomposeunicode|symlinks"
    r"|autocrlf|eol|safecrlf|quotepath|abbrev|compression|sharedrepository)"
    r"|extensions\.(objectformat|worktreeconfig)"
    r"|remote\.[^\n]*\.(url|pushurl|fetch|push|tagopt|prune|mirror)"
    r"|branch\.[^\n]*\.(remote|merge|rebase|pushremote|description)"
    r"|user\.(name|email)|init\.defaultbranch|pull\.(rebase|ff)|merge\.ff|color\.[a-z.]+"
    r"|gc\.auto|fetch\.prune|advice\.[a-z]+)"
)
GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_ATTR_NOSYSTEM": "1",
           "GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat", "GIT_EDITOR": "false",
           "GIT_SEQUENCE_EDITOR": "false", "GIT_ASKPASS": "false", "SSH_ASKPASS": "false",
           "GIT_SSH_COMMAND": "false"}  # fmt: skip
_GIT_OVERRIDES = ["-c", "safe.directory=*", "-c", "core.fsmonitor=", "-c", "core.hooksPath=/dev/null",
                  "-c", "core.sshCommand=false", "-c", "core.pager=cat", "-c", "core.editor=false",
                  "-c", "protocol.ext.allow=never", "-c", "credential.helper=", "-c", "diff.external=",
                  "-c", "gpg.program=false", "-c", "core.askPass=false"]  # fmt: skip


def git_environment(run_folder: str) -> dict[str, str]:
    """The git settings an allowlisted ``git`` gets, as environment variables, for programs
    that run git themselves (MCP servers): each ``-c key=value`` as ``GIT_CONFIG_KEY_<n>`` /
    ``GIT_CONFIG_VALUE_<n>`` (above every config file, the repository's own included), and
    ``safe.directory=*`` among them: the repository belongs to another call's uid."""
    pairs = [_GIT_OVERRIDES[i + 1].split("=", 1) for i in range(0, len(_GIT_OVERRIDES), 2)]
    config = {"GIT_CONFIG_COUNT": str(len(pairs))}
    for n, (key, value) in enumerate(pairs):
        config |= {f"GIT_CONFIG_KEY_{n}": key, f"GIT_CONFIG_VALUE_{n}": value}
    ceiling = {"GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.realpath(run_folder))}
    return {**GIT_ENV, **ceiling, **config}


def allowlisted_argv(command: str, run_folder: str) -> tuple[list[str], dict[str, str]] | None:
    """The argv (and extra environment) of a command under the run's allowlist; None
    when the run has none (``/bin/sh -c`` then runs it)."""
    allowed = os.environ.get(ALLOWED_COMMANDS_ENV)
    if allowed is None:
        return None
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise CommandRefused(f"cannot parse the command: {exc}") from None
    names = json.loads(allowed)
    if not words or words[0] not in names:
        first = words[0] if words else ""
        raise CommandRefused(
            f"{first!r} is not an allowed command (allowed: {', '.join(names) or 'none'}); "
            "commands run without a shell: no pipes, redirections or variables"
        )
    return _checked(words, run_folder)


def _checked(words: list[str], run_folder: str) -> tuple[list[str], dict[str, str]]:
    program, args = words[0], words[1:]
    base, name = os.path.basename(program), _real_name(program)
    if (_is_executor(name) or _is_executor(base)) and not {base, name} & _opted_in():
        raise CommandRefused(
            f"{program!r} runs code it is given (an interpreter or a command runner): refused even "
            f"though the run allows it, unless the operator lists it in {EXECUTORS_ENV}"
        )
    if name == "find":
        _refuse_words(program, args, _FIND)
    elif name == "tar":
        _refuse_tar(program, args)
    elif name in ("sed", "gawk"):  # GNU's own sandbox mode: no e, s///e, system(), pipes
        return [program, "--sandbox", *args], {}
    elif name == "git":  # no repository above the run's folder is looked for
        ceiling = {"GIT_CEILING_DIRECTORIES": os.path.dirname(os.path.realpath(run_folder))}
        return [program, *_GIT_OVERRIDES, *_checked_git(args, run_folder)], {**GIT_ENV, **ceiling}
    elif name == "curl":
        return [program, "-q", *args], {}  # -q first: no .curlrc (HOME is the run's folder)
    elif name == "wget":
        return [program, "--no-config", *args], {}
    return words, {}


def _real_name(program: str) -> str:
    """What runs, by name, through symlinks (``awk`` -> ``gawk`` or ``mawk``, ``vi`` -> ``vim``)."""
    found = shutil.which(program) if "/" not in program else program
    return os.path.basename(os.path.realpath(found)) if found else os.path.basename(program)


def _is_executor(name: str) -> bool:
    return name in EXECUTORS or bool(_VERSIONED.fullmatch(name)) or name.startswith("python")


def _opted_in() -> set[str]:
    return set(json.loads(os.environ.get(EXECUTORS_ENV) or "[]"))


def _refuse_words(program: str, args: list[str], refused: set[str]) -> None:
    bad = [a for a in args if a in refused]
    if bad:
        raise CommandRefused(f"{program} {bad[0]} runs commands: refused")


def _long_refused(arg: str, names: tuple[str, ...]) -> str | None:
    """``--name[=value]`` naming one of ``names``, or any prefix of it (getopt accepts those)."""
    if not arg.startswith("--") or len(arg) < 3:
        return None
    given = arg[2:].split("=", 1)[0]
    return next((n for n in names if n.startswith(given)), None)


def _refuse_tar(program: str, args: list[str]) -> None:
    for i, arg in enumerate(args):
        if arg == "--":
            return
        long = _long_refused(arg, _TAR_LONG)
        if long:
            raise CommandRefused(f"{program} --{long} runs commands: refused")
        bundle = arg[1:] if arg.startswith("-") and not arg.startswith("--") else arg if i == 0 else ""
        if set(bundle) & {"I", "F"}:  # -I PROG, -F SCRIPT (also old style: tar xIf ...)
            raise CommandRefused(f"{program} {arg}: -I/-F run commands: refused")


def _checked_git(args: list[str], run_folder: str) -> list[str]:
    i = 0
    while i < len(args) and args[i].startswith("-"):  # options before the subcommand
        arg = args[i]
        if arg in ("-c", "-C") or arg.startswith("-c") or _long_refused(arg, _GIT_GLOBAL):
            raise CommandRefused(f"git {arg}: config and paths are set by the sandbox: refused")
        i += 1
    sub = args[i] if i < len(args) else ""
    if sub in _GIT_REFUSED:
        raise CommandRefused(f"git {sub} runs commands or writes config: refused")
    for arg in args[i + 1 :]:
        if arg == "--":
            break
        long = _long_refused(arg, _GIT_LONG)
        short = _GIT_SHORT.get(sub, "")
        if long or (arg.startswith("-") and not arg.startswith("--") and set(arg[1:]) & set(short)):
            raise CommandRefused(f"git {sub} {arg} runs commands: refused")
    _refuse_repo_config(run_folder)
    return args


def _refuse_repo_config(start: str) -> None:
    """The repository's own config (``.git/config``, written by anyone with write_file)
    may hold only keys that name no command."""
    for config in _repo_configs(start):
        out = subprocess.run(["git", "config", "--file", config, "--list", "--name-only", "-z"],
                             capture_output=True, env={**os.environ, **GIT_ENV}, check=False)  # fmt: skip
        if out.returncode != 0:
            raise CommandRefused(f"the repository's config {config} does not parse: refused")
        keys = [k.lower() for k in out.stdout.decode(errors="replace").split("\0") if k]
        bad = [k for k in keys if not _GIT_SAFE_KEYS.fullmatch(k)]
        if bad:
            raise CommandRefused(f"the repository's config sets {bad[0]!r}, which may run a command: refused")


def _repo_configs(run_folder: str) -> list[str]:
    """Config files of the repository git finds in the run's folder (git runs there, and
    looks no higher: GIT_CEILING_DIRECTORIES)."""
    dot = os.path.join(run_folder, ".git")
    if os.path.isdir(dot):
        return _configs_in(dot)
    if not os.path.isfile(dot):
        return []
    with open(dot) as f:  # a worktree or submodule: "gitdir: <path>"
        gitdir = os.path.join(run_folder, f.read().strip().removeprefix("gitdir:").strip())
    found = _configs_in(gitdir)
    common = os.path.join(gitdir, "commondir")
    if os.path.isfile(common):
        with open(common) as f:
            found += _configs_in(os.path.join(gitdir, f.read().strip()))
    return found


def _configs_in(gitdir: str) -> list[str]:
    return [p for p in (os.path.join(gitdir, n) for n in ("config", "config.worktree")) if os.path.isfile(p)]

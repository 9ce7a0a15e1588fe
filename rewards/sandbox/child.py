"""Bootstrap of the sandbox's two child interpreters, run as a script by `code_sandbox`.

`child.py ROLE MEMORY_MB CPU_S ALLOW_WEAK REPORT_FD LINK_IN LINK_OUT`: isolates itself
(`jail`), reads its job from stdin (the code for the `solution` role, the tests for the
`judge`), then plays its role; `<key> <value>` lines on REPORT_FD tell the caller the
isolation that applied, a refusal (`unavailable`), the judge's `outcome`, and the solution's
`error` or `violation`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # for the modules below; taken out before any job runs
import jail  # noqa: E402
import judge  # noqa: E402
import solution  # noqa: E402
from wire import Channel  # noqa: E402

del sys.path[0]


def main(role: str, memory_mb: int, cpu_s: int, allow_weak: int, report_fd: int, link_in: int, link_out: int) -> None:
    write, exit_now = os.write, os._exit  # bound before untrusted code runs

    def report(line: str) -> None:
        write(report_fd, (line.replace("\n", " ") + "\n").encode(errors="replace"))

    try:
        layers = jail.enter(os.path.realpath(os.getcwd()), role == "solution", memory_mb, cpu_s,
                                    bool(allow_weak))
    except (OSError, jail.JailUnavailable) as err:
        report(f"unavailable {role}: {err}")
        exit_now(3)
    if role == "judge":
        jail.forbid_tracing()  # where weak isolation shares a uid, the solution cannot read it
    job, channel = sys.stdin.read(), Channel(link_in, link_out)
    if role == "judge":
        report(f"isolation {' '.join(layers)}")
        report(f"outcome {judge.run(job, channel)}")
    else:
        report(f"isolation {' '.join(layers + ['audit'])}")
        solution.run(job, channel, report)
    exit_now(0)


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:8]))

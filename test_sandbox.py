"""gmts.py's code sandbox: model-written programs are graded in processes of their own, and no
program earns a pass it did not earn by passing its tests, whatever it does to its own process,
within a bounded time, leaving no process and no file behind, and the trainer alive.

Run it (offline, CPU; it needs Linux):

    source /work/venv/bin/activate; python -m pytest -q -n 0 test_sandbox.py

Every hostile program is graded through gmts.TASKS["code"]["reward"], the reward a run uses, with
the wall clock lowered to TIMEOUT seconds (gmts.CODE_TIMEOUT_S). Each test checks the grade, the
time, that no process of the programs' users and no zygote is left, that no file is left where a
program wrote, and that this process (the trainer) still runs. The strongest mode this machine
allows is tested (sandbox_mode: ns as root here); the weaker modes are forced for what they
promise."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import ast
import site
import socket
import sys
import textwrap
import time

import pytest

import gmts

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the sandbox is Linux's")

TIMEOUT = 2.0  # seconds of wall clock per program in these tests
SLACK = 4.0  # a grade's time past TIMEOUT: the zygote's start, the machine's load
ASSERTS = {"question": "add", "tests": "assert add(2, 3) == 5\nassert add(10, -4) == 6\n"}
GOOD = "def add(a, b):\n    return a + b\n"
SECRET = "gmts-test-secret-4f1c"  # in this process's environment: no program may read it
LEFT_FILES = ("/tmp/gmts-hostile", "/var/tmp/gmts-hostile", "/dev/shm/gmts-hostile",
              os.path.join(os.path.dirname(os.path.abspath(__file__)), "gmts-hostile"),
              os.path.expanduser("~/gmts-hostile"))


def src(text: str) -> str:  # a program written indented in this file
    return textwrap.dedent(text).lstrip("\n")


def block(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\n"


def processes() -> dict:
    """{pid: (uid, ppid, cmdline)} of every process now."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            out[int(name)] = (int(status["Uid"].split()[0]), int(status["PPid"]), cmd)
        except (OSError, KeyError, ValueError):
            pass  # it ended meanwhile
    return out


def descendants(pid: int, table: dict) -> list:
    kids = [p for p, (_, ppid, _) in table.items() if ppid == pid]
    return kids + [d for k in kids for d in descendants(k, table)]


@pytest.fixture
def sandbox(monkeypatch):
    """The reward a run uses with a TIMEOUT s wall clock; after the test: no zygote, no process of a
    program's user, no new descendant of ours (helpers other tests in this process left running,
    such as wandb's, aside), no file where the hostile programs write, and no network connection
    accepted by the listener the test offers."""
    before = set(descendants(os.getpid(), processes()))
    monkeypatch.setattr(gmts, "CODE_TIMEOUT_S", TIMEOUT)
    monkeypatch.setenv("GMTS_TEST_SECRET", SECRET)
    started = []
    init = gmts.Zygote.__init__

    def record(self, mode):
        init(self, mode)
        started.append(self.proc.pid)
    monkeypatch.setattr(gmts.Zygote, "__init__", record)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    yield listener.getsockname()[1]
    deadline = time.monotonic() + 5
    while True:  # a killed process may take a moment to be reaped
        table = processes()
        users = {gmts.UID_BASE + pid for pid in started}
        left = [p for p, (uid, _, _) in table.items() if uid in users or p in started]
        left += [p for p in descendants(os.getpid(), table) if p not in before]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, [table.get(p) for p in left]
    assert started, "no program ran"
    assert not [p for p in LEFT_FILES if os.path.exists(p)]
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()


def grade(program: str, row: dict = ASSERTS) -> tuple:
    """(reward, seconds) of one program through TASKS["code"]["reward"]."""
    t = time.monotonic()
    reward = gmts.TASKS["code"]["reward"](block(program), row)
    return reward, time.monotonic() - t


def test_a_correct_program_passes_and_a_wrong_one_fails(sandbox):
    assert grade(GOOD)[0] == 1.0
    assert grade("def add(a, b):\n    return a - b\n")[0] == 0.0
    assert grade(GOOD.replace("return", "retrun"))[0] == 0.0  # a SyntaxError
    assert gmts.TASKS["code"]["reward"](GOOD, ASSERTS) == 0.0  # no block


# (name, program): each must earn 0 in bounded time, leaving nothing. {port}: the test's listener.
HOSTILE = [
    ("sys.exit(0) at the top", GOOD + "import sys\nsys.exit(0)\n"),
    ("os._exit(0) at the top", "import os\nos._exit(0)\n"),
    ("SystemExit in the function", "def add(a, b):\n    raise SystemExit(0)\n"),
    ("os._exit(0) in the function", "def add(a, b):\n    import os\n    os._exit(0)\n"),
    ("KeyboardInterrupt in the function", "def add(a, b):\n    raise KeyboardInterrupt\n"),
    ("an atexit hook that prints a pass", src("""
        import atexit
        atexit.register(print, 'pass')
        def add(a, b):
            raise SystemExit(0)
        """)),
    ("an excepthook that hides the failure", src("""
        import sys
        sys.excepthook = lambda *a: None
        def add(a, b):
            raise AssertionError
        """)),
    ("a printed pass line", src("""
        import os, sys
        print('pass')
        print('0000000004pass')
        sys.stdout.flush()
        os._exit(0)
        """)),
    ("an object equal to everything", src("""
        class Any:
            def __eq__(self, other):
                return True
            def __ne__(self, other):
                return False
        def add(a, b):
            return Any()
        """)),
    ("an int whose == always holds", src("""
        class Int(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        def add(a, b):
            return Int(0)
        """)),
    ("patched builtins", src("""
        import builtins
        builtins.AssertionError = type('X', (BaseException,), {})
        builtins.isinstance = lambda *a: True
        builtins.print = lambda *a: None
        def add(a, b):
            return 0
        """)),
    ("an endless loop at the top", "while True:\n    pass\n"),
    ("an endless loop in the function", "def add(a, b):\n    while True:\n        pass\n"),
    ("a sleep past the clock, SIGXCPU ignored", src("""
        import signal, time
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        def add(a, b):
            time.sleep(1000)
        """)),
    ("a 20 GB allocation", "x = bytearray(20 * 10**9)\n" + GOOD),
    ("20 forked sleepers", src("""
        import os, time
        for _ in range(20):
            if os.fork() == 0:
                time.sleep(1000)
        """) + GOOD),
    ("a fork bomb", "import os\nwhile True:\n    os.fork()\n"),
    ("a setsid'd daemon", src("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(1000)
        """) + GOOD),
    ("a thread left running", src("""
        import threading, time
        threading.Thread(target=time.sleep, args=(1000,)).start()
        """) + GOOD),
    ("the trainer's secret read from the environment", src("""
        import os
        def add(a, b):
            return a + b if os.environ.get('GMTS_TEST_SECRET') else 0
        """)),
    ("its parents killed", src("""
        import os, signal
        for pid in (os.getppid(), 1, -1, 0):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        def add(a, b):
            return 0
        """)),
    ("every python process it sees killed", src("""
        import os
        for pid in os.listdir('/proc'):
            try:
                if pid.isdigit() and b'python' in open(f'/proc/{pid}/cmdline', 'rb').read():
                    os.kill(int(pid), 9)
            except OSError:
                pass
        def add(a, b):
            return 0
        """)),
    ("files written outside its folder", src("""
        ok = False
        for path in %r:
            try:
                open(path, 'w').write('x')
                ok = True
            except OSError:
                pass
        def add(a, b):
            return a + b if ok else 0
        """) % (LEFT_FILES,)),
    ("a connection to the trainer's machine", src("""
        import socket
        try:
            socket.create_connection(('127.0.0.1', {port}), timeout=1)
            ok = True
        except OSError:
            ok = False
        def add(a, b):
            return a + b if ok else 0
        """)),
    ("its pipes closed and replaced", src("""
        import os
        for fd in range(10):
            try:
                os.dup2(os.open('/dev/null', os.O_RDWR), fd)
            except OSError:
                pass
        """) + GOOD),
    ("the tests read from its memory (frames, objects)", src("""
        import gc, sys
        def saw(x):
            try:
                return 'add(10, ' + '-4)' in repr(x)  # not the text itself: the program holds that
            except Exception:
                return False
        def add(a, b):
            seen, f = False, sys._getframe()
            while f:
                seen, f = seen or saw(f.f_locals), f.f_back
            seen = seen or any(saw(o) for o in gc.get_objects() if isinstance(o, (dict, list)))
            return a + b if seen else 0
        """)),
    ("the judge's fds and memory read through /proc", src("""
        import os
        ok = False
        for pid in {os.getppid(), 1}:
            for name in ('fd/0', 'fd/1', 'mem', 'environ'):
                try:
                    os.read(os.open(f'/proc/{pid}/{name}', os.O_RDONLY | os.O_NONBLOCK), 1)
                    ok = True
                except OSError:
                    pass
        def add(a, b):
            return a + b if ok else 0
        """)),
    ("a reply larger than the cap", "def add(a, b):\n    return 'x' * (8 * 2**20)\n"),
    ("a stopped process", "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\n" + GOOD),
]
ANY = HOSTILE[8][1]  # an object equal to everything


def test_every_hostile_program_is_python():  # so that none fails for its syntax alone
    for name, program in HOSTILE:
        ast.parse(program.replace("{port}", "1"), name)


@pytest.mark.parametrize("name, program", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_program_earns_nothing_in_bounded_time_and_leaves_nothing(sandbox, name, program):
    reward, seconds = grade(program.replace("{port}", str(sandbox)))
    assert reward == 0.0, name
    assert seconds < TIMEOUT + SLACK, f"{name}: {seconds:.1f} s"
    assert grade(GOOD)[0] == 1.0  # the sandbox still grades, and the trainer (this process) lives


HELPER = {"question": "unrotate", "entry": "unrotate",  # HumanEval's way: a helper in the prompt
          "setup": "def rotate(s, k):\n    return s[k:] + s[:k]\n",
          "tests": "for s in ('abc', 'hello'):\n    assert unrotate(rotate(s, 2), 2) == s\n"}
# (name, program, row): a cheat on what the tests themselves use; each must earn 0
ON_THE_TESTS = [
    ("a builtin the tests call, shadowed", src("""
        def abs(x):
            return 0
        def add(a, b):
            return 0
        """), {"question": "add", "tests": "assert abs(add(0.1, 0.2) - 0.3) < 1e-9\n"}),
    ("the prompt's helper redefined", src("""
        def rotate(s, k):
            return s
        def unrotate(s, k):
            return s
        """), HELPER),
    ("StopIteration that ends the tests' map() early", src("""
        def add(a, b):
            raise StopIteration
        """), {"question": "add", "tests": "assert all(map(lambda c: add(*c[:2]) == c[2], "
                                            "[(1, 2, 3), (2, 2, 4)]))\n"}),
    ("a module name the tests use, taken", src("""
        def math():
            pass
        def add(a, b):
            return 0
        """), {"question": "add", "tests": "assert math.isclose(add(1, 2), 3)\n"}),
]


@pytest.mark.parametrize("name, program, row", ON_THE_TESTS, ids=[c[0] for c in ON_THE_TESTS])
def test_a_program_cannot_change_what_the_tests_use(sandbox, name, program, row):
    """Builtins, the names the row's setup defines (all but its entry point) and the modules the
    tests may use unimported are the tests' own; a program's StopIteration is an error there."""
    assert grade(program, row)[0] == 0.0, name
    honest = {"add": GOOD, "unrotate": "def unrotate(s, k):\n    return s[-k:] + s[:-k]\n"}
    assert grade(honest[row["question"]], row)[0] == 1.0


def test_the_reward_of_a_program_that_would_pass_if_it_could_cheat_is_its_honest_one(sandbox):
    """The same cheats wrapped around a correct function: still 1.0, as earned by the tests."""
    for prefix in ("import atexit\natexit.register(print, 'fail')\n",
                   "import builtins\nbuiltins.print = None\n"):
        assert grade(prefix + GOOD)[0] == 1.0


STDIO = {"question": "sum, min, max", "inputs": ["3\n4 -2 7\n", "1\n5\n"],
         "outputs": ["9\n-2\n7\n", "5\n5\n5"]}
READ = "n = int(input())\na = list(map(int, input().split()))\n"
ALL = READ + "print(sum(a))\nprint(min(a))\nprint(max(a))\n"


@pytest.mark.parametrize("program, want", [
    (ALL, 1.0),
    (ALL.replace("sum(a))", "sum(a), '  ')") + "print()\nprint('\\t')\n", 1.0),  # trailing blanks
    (READ + "import sys\nsys.stdout.write(f'{sum(a)}\\r\\n{min(a)}\\r\\n{max(a)}')\n", 1.0),  # CRLF
    (READ + "print(sum(a))\n", 0.0),  # the first line only: a zip would pass it
    (ALL + "print(0)\n", 0.0),  # a line more
    (ALL.replace("print(sum(a))", "print(' ' + str(sum(a)))"), 0.0),  # a leading space counts
    (ALL + "import os\nos._exit(0)\n", 0.0),  # its output never flushed
    (ALL + "import sys\nsys.stdout.flush()\nsys.exit(1)\n", 0.0),  # a failure status
    (ALL + "import sys\nsys.stdout.flush()\nsys.exit(0)\n", 1.0),
    ("while True:\n    print('x' * 10**6)\n", 0.0),  # an output flood: the file size limit
    ("import os\nos.write(1, b'9\\n-2\\n7\\n')\nos._exit(0)\n", 0.0),  # right for one input only
])
def test_stdio_compares_the_whole_output(sandbox, program, want):
    reward, seconds = grade(program, STDIO)
    assert reward == want and seconds < TIMEOUT + SLACK


def test_a_batch_runs_in_parallel_and_within_its_bound(sandbox):
    """Eight endless loops in a batch take about a wall clock per worker, not eight; identical
    programs run once; the verdicts stay in order."""
    loops = [block(f"# {i}\nwhile True:\n    pass\n") for i in range(8)]
    good = [block(GOOD)] * 4
    t = time.monotonic()
    rewards = gmts.TASKS["code"]["rewards"](loops[:4] + good + loops[4:], [ASSERTS] * 12)
    seconds = time.monotonic() - t
    assert rewards == [0.0] * 4 + [1.0] * 4 + [0.0] * 4
    workers = min(len(os.sched_getaffinity(0)), 8)
    assert seconds < 8 / workers * TIMEOUT + 2 * SLACK


def test_a_zygote_killed_mid_batch_fails_only_its_program(sandbox, monkeypatch):
    """A program that takes its whole sandbox down (its zygote killed from outside) earns 0; the
    next ones are graded by a new zygote."""
    runs = []
    run = gmts.Zygote.run

    def kill_on_second(self, code, row, timeout=None):
        runs.append(code)
        if len(runs) == 2:
            os.killpg(self.proc.pid, 9)
        return run(self, code, row, timeout)
    monkeypatch.setattr(gmts.Zygote, "run", kill_on_second)
    programs = [block(f"# {i}\n{GOOD}") for i in range(4)]
    rewards = gmts.run_programs([(gmts.last_code_block(p), ASSERTS) for p in programs], workers=1)
    assert rewards == [True, False, True, True]


def test_the_machine_gives_namespaces_as_root():
    """On Linux as root with unshare (this machine, CI) the strongest mode is taken, the mode
    README names. Elsewhere this test says which mode the machine gives."""
    mode = gmts.sandbox_mode()
    if os.geteuid() == 0 and gmts.shutil.which(gmts.UNSHARE):
        assert mode == "ns"
    else:
        assert mode in ("userns", "uid", "plain")


@pytest.mark.parametrize("mode", ["ns", "userns", "uid", "plain"])
def test_every_mode_grades_right_and_fails_early_exits(mode, monkeypatch):
    """Each mode the probe may choose grades a correct program 1 and an early exit or a cheat 0
    (as root here: plain runs its programs as root, so only harmless ones run in it; uid needs a
    Python others can read, which one under /root is not)."""
    if os.geteuid() != 0 and mode in ("ns", "uid"):
        pytest.skip("needs root")
    box = gmts.Zygote(mode)
    try:
        canary = [box.run(code, row, timeout=TIMEOUT) for code, row in gmts.CANARY]
        if mode == "uid" and canary != [True, True]:
            pytest.skip("a program's own user cannot read this Python's standard library")
        assert canary == [True, True]
        assert box.run(GOOD, ASSERTS, TIMEOUT) is True
        assert box.run("def add(a, b):\n    return a * b\n", ASSERTS, TIMEOUT) is False
        assert box.run("import os\nos._exit(0)\n", ASSERTS, TIMEOUT) is False
        assert box.run(ANY, ASSERTS, TIMEOUT) is False
        assert box.run(GOOD, ASSERTS, TIMEOUT) is True
    finally:
        box.close()
    assert box.base is None or not os.path.exists(box.base)  # the weaker modes' folder


@pytest.mark.parametrize("mode", ["ns", "userns"])
def test_a_python_folder_under_tmp_is_seen_read_only_in_the_box(mode, tmp_path, monkeypatch):
    """A venv under /tmp (CI's is in a mktemp folder) is bound above the box's own /tmp, not hidden
    by it: a program imports from it, cannot write to it, and what the program leaves in /tmp goes
    while the venv's folder stays for the next program."""
    if os.geteuid() != 0 and mode == "ns":
        pytest.skip("needs root")
    plain = gmts.Zygote(mode)  # with this Python's own folders, wherever they are
    works = plain.run(*gmts.CANARY[0], timeout=TIMEOUT) is True
    plain.close()
    if not works:
        pytest.skip(f"no {mode} sandbox on this machine")
    assert str(tmp_path).startswith("/tmp/")
    site_dir = tmp_path / "venv" / "site-packages"
    site_dir.mkdir(parents=True)
    (site_dir / "gmts_probe_module.py").write_text("VALUE = 5\n")
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(site_dir)])
    importing = src("""
        import gmts_probe_module
        def add(a, b):
            return a + b if gmts_probe_module.VALUE == 5 else 0
        """)
    writing = src(f"""
        open({str(site_dir / "new.py")!r}, "w").write("x")
        def add(a, b):
            return a + b
        """)
    leaving = GOOD + "open('/tmp/left-behind', 'w').write('x')\n"
    probe = src("""
        import os
        def add(a, b):
            return a + b if not os.path.exists('/tmp/left-behind') else 0
        """)
    box = gmts.Zygote(mode)
    try:
        assert box.run(*gmts.CANARY[0], timeout=TIMEOUT) is True
        assert box.run(importing, ASSERTS, TIMEOUT) is True
        assert box.run(writing, ASSERTS, TIMEOUT) is False
        box.run(leaving, ASSERTS, TIMEOUT)
        assert box.run(probe, ASSERTS, TIMEOUT) is True
        assert box.run(importing, ASSERTS, TIMEOUT) is True
    finally:
        box.close()
    assert sorted(os.listdir(site_dir)) == ["gmts_probe_module.py"]


def test_values_cross_between_tests_and_program_as_plain_data_only(sandbox):
    """The tests see the program's results as plain values of their own: containers, numbers, text,
    None, nested; a program's exception is raised in the tests by its builtin type."""
    program = src("""
        def echo(x):
            return x
        def fail(kind):
            mine = type('Mine', (Exception,), {})
            raise {'v': ValueError, 'k': KeyError, 'c': mine}[kind]('no')
        def gen():
            return (i for i in range(3))
        """)
    tests = src(r"""
        import math
        for v in [0, -7, 2**100, 1.5, float('inf'), 1e-300, 2j, 'é\n', b'\x00', None, True,
                  False, [1, [2, (3, {4})]], (), {'a': [1.0]}, {1: 2, (3, 4): frozenset([5])},
                  set()]:
            got = echo(v)
            assert got == v and type(got) is type(v), (v, got)
        assert math.isnan(echo(float('nan')))
        for kind, error in (('v', ValueError), ('k', KeyError), ('c', RuntimeError)):
            try:
                fail(kind)
                raise SystemExit
            except error:
                pass
        try:
            gen()
            raise SystemExit
        except TypeError:
            pass
        """)
    assert grade(program, {"question": "echo", "tests": tests})[0] == 1.0

"""Environment prep without Docker: the Dockerfile subset parses like Docker reads it, and the bwrap backend
replays RUN/COPY/WORKDIR/ENV/USER (or runs environment/setup.sh) as the sandbox user, skipping installs of what
the host has, mapping user and ownership steps, and naming the step or package that cannot work."""

import pathlib
import textwrap

import pytest

from asyncres_jax.envs import bwrap
from asyncres_jax.envs.dockerfile import expand, parse_dockerfile, parse_env
from asyncres_jax.envs.sandbox import SandboxStartError
from asyncres_jax.envs.task import load_task
from asyncres_jax.errors import UserError
from bwrap_support import backend  # noqa: F401  (the shared module-scoped fixture)


# --- the parser (no sandbox needed) ------------------------------------------------------------------------

def test_parser_joins_continuations_like_docker_and_reads_heredocs():
    steps = parse_dockerfile(textwrap.dedent("""\
        # comment
        FROM ubuntu:22.04
        RUN apt-get update && \\
            # a comment inside a continuation is dropped
            apt-get install -y python3
        RUN cat > /home/user/a.txt <<'EOF'
        line $HOME
        EOF
        RUN <<EOT
        echo one
        echo two
        EOT
        COPY --chown=user:user ["data.txt", "/home/user/data.txt"]
        ENV A=1 B="two words"
        ENV LEGACY value with spaces
        """))
    assert [s.instruction for s in steps] == ["FROM", "RUN", "RUN", "RUN", "COPY", "ENV", "ENV"]
    assert steps[1].text == "apt-get update &&     apt-get install -y python3" and steps[1].line == 3
    assert steps[2].shell_script() == "cat > /home/user/a.txt <<'EOF'\nline $HOME\nEOF"
    assert steps[3].shell_script() == "echo one\necho two"
    assert steps[4].flags_and_args() == ({"chown": "user:user"}, ["data.txt", "/home/user/data.txt"])
    assert parse_env(steps[5]) == {"A": "1", "B": "two words"}
    assert parse_env(steps[6]) == {"LEGACY": "value with spaces"}
    assert expand("${HOME}/x:$A:${MISSING:-d}", {"HOME": "/home/user", "A": "1"}) == "/home/user/x:1:d"


def test_parser_names_the_line_of_an_unclosed_heredoc():
    with pytest.raises(UserError, match="line 2: heredoc <<EOF is never closed"):
        parse_dockerfile("FROM x\nRUN cat > f <<EOF\nbody\n")


# --- replay in the sandbox --------------------------------------------------------------------------------


def make_task(root: pathlib.Path, name: str, dockerfile: str | None = None, setup: str | None = None,
              files: dict[str, str] | None = None):
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "instruction.md").write_text("do it\n")
    (d / "task.toml").write_text("")
    if dockerfile is not None:
        (d / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    if setup is not None:
        (d / "environment" / "setup.sh").write_text(setup)
    for rel, text in (files or {}).items():
        (d / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / "environment" / rel).write_text(text)
    (d / "tests" / "test_final_state.py").write_text("def test_x():\n    assert False\n")
    return load_task(d)


ET_DOCKERFILE = """\
    FROM ubuntu:22.04
    ENV DEBIAN_FRONTEND=noninteractive
    ARG GREETING=hi
    RUN apt-get update && apt-get install -y python3 python3-pip python3-pytest && \\
        pip3 install --no-cache-dir pytest && apt-get clean && rm -rf /var/lib/apt/lists/*
    RUN useradd -m -s /bin/bash user || true
    RUN mkdir -p /home/user/project && \\
        printf '%s\\n' 'a,b' '1,2' > /home/user/project/data.csv
    COPY notes.txt /home/user/project/
    COPY conf/ /home/user/conf/
    ENV APP_MODE=test PATH=/home/user/bin:$PATH
    WORKDIR /home/user/project
    RUN echo "$GREETING from $(pwd) as $(id -un)" > hello.txt && touch -d @1600000000 data.csv
    RUN cat > /home/user/project/script.sh <<'EOF'
    #!/bin/sh
    echo "$APP_MODE"
    EOF
    RUN chmod +x /home/user/project/script.sh && chown -R user:user /home/user && chmod 755 /home/user
    USER user
    """


@pytest.mark.bwrap
def test_et_style_dockerfile_is_replayed_as_the_sandbox_user(backend, tmp_path):
    t = make_task(tmp_path, "et", ET_DOCKERFILE, files={"notes.txt": "n\n", "conf/app.ini": "[a]\n"})
    with backend.start(t) as sb:
        r = sb.run("pwd; cat hello.txt notes.txt ../conf/app.ini; ./script.sh; stat -c %Y data.csv; "
                   "echo $PATH; stat -c %U /home/user/project/data.csv")
        assert r.exit_code == 0, r.output
        assert r.output.split("\n") == ["/home/user/project", "hi from /home/user/project as user", "n", "[a]",
                                        "test", "1600000000", "/home/user/bin:" + bwrap.BASE_PATH, "user", ""]


@pytest.mark.bwrap
def test_the_copied_home_keeps_links_fifos_modes_and_times(backend, tmp_path):
    t = make_task(tmp_path, "kinds", "FROM ubuntu:22.04\nRUN cd /home/user && echo a > f && ln f hard && "
                  "ln -s f soft && mkfifo pipe && chmod 600 f && mkdir d && touch -d @1500000000 d f\n")
    with backend.start(t) as sb:
        r = sb.run("stat -c '%n %h %a %Y %F' f hard d; stat -c '%n %F' pipe; readlink soft")
    assert r.output.split("\n") == ["f 2 600 1500000000 regular file", "hard 2 600 1500000000 regular file",
                                     "d 2 755 1500000000 directory", "pipe fifo", "f", ""]


@pytest.mark.bwrap
def test_the_prepared_home_is_built_once_per_task(backend, tmp_path):
    t = make_task(tmp_path, "once", "FROM ubuntu:22.04\nRUN head -c 8 /dev/urandom | od -An -tx1 > /home/user/r\n")
    with backend.start(t) as a, backend.start(t) as b:
        ra, rb = a.run("cat r").output, b.run("cat r").output
    assert ra == rb and len(ra.split()) == 8


@pytest.mark.bwrap
def test_setup_script_is_preferred(backend, tmp_path):
    t = make_task(tmp_path, "setup", "FROM ubuntu:22.04\nRUN echo docker > /home/user/who\n",
                  setup="echo setup > /home/user/who\n")
    with backend.start(t) as sb:
        assert sb.run("cat who").output == "setup\n"


@pytest.mark.bwrap
@pytest.mark.parametrize("dockerfile, named", [
    ("FROM ubuntu:22.04\nRUN echo ok\nRUN mkdir -p /opt/app && echo x > /opt/app/y\n",
     r"(?s)line 3 \(RUN mkdir -p /opt/app.*can only write under /home/user, /tmp and new top-level folders"),
    ("FROM ubuntu:22.04\nRUN apt-get update && apt-get install -y python3 asyncres-no-such-pkg\n",
     r"(?s)line 2 .*apt package 'asyncres-no-such-pkg' is not installed on the host"),
    ("FROM ubuntu:22.04\nRUN pip3 install pytest asyncres_no_such_module==1.0\n",
     r"(?s)line 2 .*pip package 'asyncres_no_such_module' is not installed on the host"),
    ("FROM ubuntu:22.04\nCOPY app.py /usr/local/bin/app.py\n",
     r"line 2 \(COPY app.py /usr/local/bin/app.py\) writes to /usr/local/bin/app.py, a system folder"),
    ("FROM ubuntu:22.04\nWORKDIR /etc/app\n", r"line 2 \(WORKDIR /etc/app\) writes to /etc/app"),
])
def test_impossible_steps_are_clear_errors_naming_the_step(backend, tmp_path, dockerfile, named):
    t = make_task(tmp_path, "bad", dockerfile, files={"app.py": "print(1)\n"})
    with pytest.raises(SandboxStartError, match=named) as e:
        backend.start(t)
    assert "\n" not in str(e.value)  # one line, as a JSON line or a log line carries it


@pytest.mark.bwrap
def test_new_top_level_folders_become_writable_trees(backend, tmp_path):
    """Harbor's WORKDIR /app, COPY into it and another user's home: prepared like /home/user, and the agent
    and the verifier start in the WORKDIR; HOME stays /home/user."""
    t = make_task(tmp_path, "app", """\
        FROM ubuntu:22.04
        RUN mkdir -p /app/data && echo seed > /app/data/seed.txt
        COPY app.py /app/
        COPY app.py /home/app/copy.py
        WORKDIR /app
        RUN echo "built in $(pwd)" > built.txt
        """, files={"app.py": "print(1)\n"})
    with backend.start(t) as a, backend.start(t) as b:
        r = a.run("pwd; cat built.txt data/seed.txt; python3 app.py; ls /home/app; echo $HOME; echo mine > out.txt")
        assert r.output == "/app\nbuilt in /app\nseed\n1\ncopy.py\n/home/user\n", r.output
        assert b.run("ls").output == "app.py\nbuilt.txt\ndata\n"  # each sandbox has its own copy
    assert backend.template(t).workdir == "/app"

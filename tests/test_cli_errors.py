"""The shared CLI wrapper turns a UserError into one line on stderr and exit code 2."""

from asyncres_jax.errors import UserError, cli_main


def test_user_error_is_one_line_and_exit_2(capsys):
    @cli_main
    def main():
        raise UserError("--mesh 3x1 does not fit 8 devices; use 8x1, 4x2 or 2x4")

    assert main() == 2
    err = capsys.readouterr().err
    assert err == "error: --mesh 3x1 does not fit 8 devices; use 8x1, 4x2 or 2x4\n"


def test_success_returns_zero():
    assert cli_main(lambda: None)() == 0

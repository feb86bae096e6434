"""Notes are `> note:` lines, once per job: rank 0 prints, each text once per process."""
from common import forget_notes, note


def test_a_note_is_printed_once_by_rank_0(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert note("--foo does nothing here") and not note("--foo does nothing here")
    assert capsys.readouterr().out == "> note: --foo does nothing here\n"
    forget_notes()
    assert note("--foo does nothing here")


def test_other_ranks_stay_quiet_unless_the_note_is_their_own(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert not note("a job-wide note")
    assert note("this rank's disk is slow", every_rank=True)
    assert capsys.readouterr().out == "[rank 3] > note: this rank's disk is slow\n"

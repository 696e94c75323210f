from demo.curve import table


def test_training_log_renders_as_markdown() -> None:
    rows = [{"step": 250, "minutes": 7.4, "exact": 0.2324}, {"step": 500, "exact": 0.71875, "token": 0.9}]
    assert table(rows).splitlines() == [
        "| step | minutes | exact | token |", "|---|---|---|---|",
        "| 250 | 7.4 | 0.23 |  |", "| 500 |  | 0.72 | 0.90 |"]
    assert table(rows, ["step", "exact"]).splitlines()[2] == "| 250 | 0.23 |"

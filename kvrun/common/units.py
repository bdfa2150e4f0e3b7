"""Quantities as a person reads them, the same in the dashboard and in the events."""


def duration_text(seconds: float) -> str:
    """Whole seconds, with minutes from one minute on: "42 s", "15 min 0 s"."""
    seconds = round(seconds)
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"

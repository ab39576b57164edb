"""The example view's result rebuilt from its JSON export, and its verdict line."""
from .run import NextTokenResult


def reopen(d: dict) -> NextTokenResult:
    return NextTokenResult(**d)


def verdict(result: NextTokenResult) -> tuple[str, str]:
    return result.verdict, result.explanation

import pytest

from tearless.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()

"""errors.check_s3_url: the one check of an s3://BUCKET/PREFIX argument that backends and the CLI share."""

from __future__ import annotations

import pytest

from artcloud.errors import InvalidArgument, check_s3_url


@pytest.mark.parametrize("good", [None, "s3://b", "s3://bucket/prefix"])
def test_an_s3_url_or_none_passes_as_it_is(good):
    assert check_s3_url(good) == good


@pytest.mark.parametrize("bad", ["", "s3://", "bucket/prefix", "S3://b/p", "https://b.s3.amazonaws.com/p"])
def test_anything_else_is_an_invalid_argument_that_says_what_to_write(bad):
    with pytest.raises(InvalidArgument) as e:
        check_s3_url(bad, what="--s3")
    assert str(e.value) == f"--s3 must look like s3://BUCKET/PREFIX, not {bad!r}" and e.value.field == "--s3"

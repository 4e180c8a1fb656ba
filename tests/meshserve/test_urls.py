"""``redact_url``: a store URL as messages and logs show it, without its credentials."""

import pytest

from meshserve.urls import redact_url


@pytest.mark.parametrize("url, shown", [
    ("redis://user:s3cret@redis.internal:6379/0", "redis://***@redis.internal:6379/0"),
    ("redis://:s3cret@127.0.0.1:6379/2", "redis://***@127.0.0.1:6379/2"),
    ("rediss://user@redis.internal/0", "rediss://***@redis.internal/0"),
    ("unix://user:s3cret@/run/redis.sock?db=1", "unix://***@/run/redis.sock?db=1"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("memory", "memory"),
    # unescaped characters a URL parser would read as the end of the userinfo
    ("redis://user:pa/ss@h:1/0", "redis://***@h:1/0"),
    ("redis://user:pa?ss@h:1/0", "redis://***@h:1/0"),
    ("redis://user:p@ss@h:1/0", "redis://***@h:1/0"),
    # redis-py also reads credentials from the query
    ("redis://h:1/0?username=user&password=s3cret&health_check_interval=2",
     "redis://h:1/0?username=***&password=***&health_check_interval=2"),
    ("unix:///run/redis.sock?Password=s3c@ret#x", "unix:///run/redis.sock?Password=***#x"),
    # found by a review: keys redis-py decodes, its TLS key's password, a URL without "://"
    ("redis://h:1/0?pass%77ord=s3cret&db=0", "redis://h:1/0?pass%77ord=***&db=0"),
    ("rediss://h/0?ssl_password=s3cret", "rediss://h/0?ssl_password=***"),
    ("redis:/user:s3cret@h:6379/0", "***@h:6379/0"),
    ("user:s3cret@h:6379", "***@h:6379"),
])
def test_a_url_is_shown_without_its_user_and_password(url, shown):
    assert redact_url(url) == shown

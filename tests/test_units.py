import pytest

from k3serve.units import SizeError, format_size, parse_size


def test_parse_size_reads_binary_and_decimal_units():
    assert parse_size("8G") == 8 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("1.5GB") == 1_500_000_000
    assert parse_size(" 4 k ") == 4096 and parse_size("1048576") == 1 << 20 and parse_size(123) == 123
    for bad in ("lots", "8X", "", "-1G", "1.2.3G"):
        with pytest.raises(SizeError, match="cannot read size"):
            parse_size(bad)


def test_format_size_picks_the_largest_unit():
    assert format_size(8 << 30) == "8.00 GiB" and format_size(1536) == "1.50 KiB" and format_size(12) == "12 B"
    assert format_size(8_000_000_000) == "7.45 GiB"

"""One-off measurements, run as `spd measure NAME`."""

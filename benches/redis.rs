//! Charges per second through the Redis store.

fn main() {}

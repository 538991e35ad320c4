//! strata: the command-line client of the strata API.

fn main() {}

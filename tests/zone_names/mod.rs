//! Zone names the model tests share.

/// Every name of UTC the zone database has (its aliases, `GMT` among them).
pub const UTC_NAMES: &[&str] = &[
    "UTC",
    "Etc/UTC",
    "Etc/UCT",
    "UCT",
    "Etc/Zulu",
    "Zulu",
    "Universal",
    "Etc/Universal",
    "GMT",
    "Etc/GMT",
    "Etc/GMT+0",
    "Etc/GMT-0",
    "Etc/GMT0",
    "GMT0",
    "GMT+0",
    "GMT-0",
    "Greenwich",
    "Etc/Greenwich",
];

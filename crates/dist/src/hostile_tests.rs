//! Hostile and malformed peers (filled in below).

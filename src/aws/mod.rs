//! What fencegate needs of AWS's S3 protocol besides the S3 library: the header names looked
//! up on the request path ([`amz`]) and SigV4, signing forwarded requests and the lean check of
//! received ones ([`sigv4`]).

pub mod amz;
pub mod sigv4;

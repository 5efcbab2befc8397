//! Sans-IO TCP for the Capybara stack: the TCP wire format and the connection
//! state machine (handshake with options, RFC 6298 retransmission, fast
//! retransmit, SACK, flow and congestion control, every closing state). It
//! takes segments and `now`, and yields segments, timers and socket events;
//! it never reads a clock or a socket.
